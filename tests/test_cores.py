"""The cores `specmesh up` gives its verifier (specmesh/ops/cores.py)."""

from __future__ import annotations

import os

from specmesh.config import DraftConfig, GatewayConfig, VerifierConfig, load_config
from specmesh.ops.cores import cpu_list, draft_host_share_env, draft_threads_env, num_cores, verifier_threads_env
from specmesh.ops.launcher import Stack, StackConfig


def test_cpu_lists_and_the_cores_a_child_may_use() -> None:
    assert cpu_list("0-2,5") == {0, 1, 2, 5} and cpu_list("1") == {1}
    assert num_cores("0") == 1 and num_cores("0-3") == 4
    assert num_cores() == len(os.sched_getaffinity(0))


def test_a_verifier_beside_the_draft_service_runs_its_steps_on_every_core_and_leaves_them_to_its_drafts() -> None:
    env = verifier_threads_env(1, 2, shares_cores_with_draft=True, user_env={})
    config = load_config(VerifierConfig, "verifier", argv=[], env=env)
    assert config.engine.num_threads == 1 and config.engine.num_threads_max == 2
    assert config.engine.max_threads_min_tokens == 1      # every step, a one-row decode included
    assert not config.decode_ahead_beside_drafts          # while a session's caller drafts, the draft has the cores
    alone = verifier_threads_env(1, 4, shares_cores_with_draft=False, user_env={})
    assert alone["SPECMESH_VERIFIER_NUM_THREADS_MAX"] == "4"
    assert load_config(VerifierConfig, "verifier", argv=[], env=alone).decode_ahead_beside_drafts


def test_a_draft_service_on_the_verifiers_cores_drafts_on_all_of_them_and_not_ahead() -> None:
    env = draft_threads_env(1, "0-1", "0-1", {})
    config = load_config(DraftConfig, "draft", argv=[], env=env)
    assert config.engine.num_threads == 2 and not config.draft_ahead
    assert draft_threads_env(1, "0-1", "1", {}) == {"SPECMESH_DRAFT_NUM_THREADS": "1",   # its one core is shared
                                                    "SPECMESH_DRAFT_DRAFT_AHEAD": "false"}
    apart = draft_threads_env(1, "0", "1", {})              # pinned apart: its own threads, drafting ahead
    assert apart == {"SPECMESH_DRAFT_NUM_THREADS": "1"}
    assert load_config(DraftConfig, "draft", argv=[], env=apart).draft_ahead
    user = {"SPECMESH_DRAFT_NUM_THREADS": "1"}              # what the user set wins
    assert draft_threads_env(1, "0-1", "0-1", user) == {"SPECMESH_DRAFT_DRAFT_AHEAD": "false"}


def test_a_pinned_verifier_or_one_given_every_core_keeps_its_threads() -> None:
    assert verifier_threads_env(1, 1, False, {}) == {"SPECMESH_VERIFIER_NUM_THREADS": "1"}
    assert verifier_threads_env(2, 2, True, {}) == {"SPECMESH_VERIFIER_NUM_THREADS": "2",
                                                    "SPECMESH_VERIFIER_DECODE_AHEAD_BESIDE_DRAFTS": "false"}


def test_what_the_user_set_wins() -> None:
    env = verifier_threads_env(1, 2, True, {"SPECMESH_VERIFIER_NUM_THREADS_MAX": "0"})
    assert "SPECMESH_VERIFIER_NUM_THREADS_MAX" not in env
    config = load_config(VerifierConfig, "verifier", argv=[], env={**env, "SPECMESH_VERIFIER_NUM_THREADS_MAX": "0"})
    assert config.engine.num_threads_max == 0


def test_the_launcher_raises_the_threads_of_an_unpinned_verifier_only() -> None:
    pinned = StackConfig(target="tiny-target", draft="tiny-draft", taskset={"verifier": "0", "draft": "1"})
    assert "SPECMESH_VERIFIER_NUM_THREADS_MAX" not in Stack(pinned).verifier_env()
    assert "SPECMESH_VERIFIER_DECODE_AHEAD_BESIDE_DRAFTS" not in Stack(pinned).verifier_env()   # cores apart
    unpinned = Stack(StackConfig(target="tiny-target", draft="tiny-draft")).verifier_env()
    assert unpinned["SPECMESH_VERIFIER_NUM_THREADS"] == "1"
    assert unpinned["SPECMESH_VERIFIER_DECODE_AHEAD_BESIDE_DRAFTS"] == "false"
    if num_cores() > 1:
        assert unpinned["SPECMESH_VERIFIER_NUM_THREADS_MAX"] == str(num_cores())


def test_the_launchers_draft_service_takes_turns_with_the_verifier_on_shared_cores() -> None:
    stack = Stack(StackConfig(target="tiny-target", draft="tiny-draft"))
    env = stack._draft_env(50062)
    assert env["SPECMESH_DRAFT_NUM_THREADS"] == str(num_cores()) and env["SPECMESH_DRAFT_DRAFT_AHEAD"] == "false"
    assert stack._draft_share_env() == {"SPECMESH_GATEWAY_DRAFT_HOST_SHARE": "1"}     # all the verifier's cores
    pinned = Stack(StackConfig(target="tiny-target", draft="tiny-draft", taskset={"verifier": "0", "draft": "1"}))
    assert pinned._draft_env(50062)["SPECMESH_DRAFT_NUM_THREADS"] == "1"
    assert "SPECMESH_DRAFT_DRAFT_AHEAD" not in pinned._draft_env(50062) and pinned._draft_share_env() == {}


def test_the_gateway_is_told_what_a_draft_takes_from_the_verifiers_cores() -> None:
    name = "SPECMESH_GATEWAY_DRAFT_HOST_SHARE"
    assert draft_host_share_env(1, "0-1", "0-1", {}) == {name: "0.5"}          # one host, 2 cores: half
    assert draft_host_share_env(1, "0-1", "1", {}) == {name: "0.5"}            # the draft's core is one of them
    assert draft_host_share_env(1, "0", "1", {}) == {}                         # pinned apart: nothing shared
    assert draft_host_share_env(2, "0", "0", {}) == {name: "1"}
    assert draft_host_share_env(1, "0-1", "0-1", {name: "0"}) == {}            # what the user set wins
    config = load_config(GatewayConfig, "gateway", argv=[], env=draft_host_share_env(1, "0-3", "0-3", {}))
    assert config.draft_host_share == 0.25
    pinned = StackConfig(target="tiny-target", draft="tiny-draft", taskset={"verifier": "0", "draft": "1"})
    assert name not in Stack(pinned)._draft_share_env()
    assert name not in Stack(StackConfig(target="tiny-target", draft=""))._draft_share_env()   # no draft service
    unpinned = Stack(StackConfig(target="tiny-target", draft="tiny-draft"))._draft_share_env()
    assert float(unpinned[name]) == 1          # the draft service takes turns with the verifier on all its cores
