"""bench.placement's traffic and accounting (no stack, no model)."""

from __future__ import annotations

import pytest

from bench import placement


def test_traffic_sends_every_systems_first_request_first() -> None:
    prompts = placement.traffic(3, 2, words=4)
    assert len(prompts) == 6
    assert [p.split(":")[0] for p in prompts[:3]] == ["System 0", "System 1", "System 2"]
    assert prompts[3].startswith(placement.system_prompt(0, 4)) and "Question 1" in prompts[3]


def test_shared_block_tokens_counts_full_blocks_inside_the_system_prompt() -> None:
    assert placement.shared_block_tokens(list(range(60)), system_len=40) == 32     # 38 usable -> 2 blocks
    assert placement.shared_block_tokens(list(range(16)), system_len=40) == 0      # no full block + 1 token
    result = placement.ArmResult("prefix", 4, 200, 50, 100, 64, 2.0)
    assert (result.hit_rate, result.best_hit_rate, result.tokens_per_s) == (0.25, 0.5, 32.0)


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(SystemExit):
        placement.main(["--placement", "prefix,random"])
