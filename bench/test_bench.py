"""Fast checks of the benchmark harness (no stack, no model): `.venv/bin/pytest bench/test_bench.py`."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench import kv_accounting as kv
from bench import speedup
from bench.common import DEFAULT_WORKLOAD, Prompt, RequestResult, first_mismatch, load_workload
from bench.llamacpp_peer import PeerRun, chat_body, mark_identical, server_command
from bench.llamacpp_peer import summarize as peer_summarize
from bench.run_workload import check_pairs, summarize
from bench.speedup_arms import (
    ARM_ENV,
    LAYOUTS,
    arm_k,
    layout_arms,
    missing_features,
    parse_run_key,
    prompt_cap,
    run_key,
)
from bench.speedup_goals import format_goal, goals_for_length, greedy_goal, limiting_term, round_terms
from bench.speedup_stats import analytic_speedup, pooled_acceptance, position_acceptance, speedups
from gateway.verify_cost import VerifyCost
from specmesh.ops.cores import cpu_list
from specmesh.ops.launcher import Stack, StackConfig


def test_workload_dedupes_repeated_prompts_by_default(tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the default path must resolve against the repository root too
    try:
        distinct = load_workload(DEFAULT_WORKLOAD)
        expanded = load_workload(DEFAULT_WORKLOAD, dedupe=False)
    finally:
        os.chdir(cwd)
    assert len({p.id for p in distinct}) == len(distinct)
    repeated = [p for p in distinct if p.repeat > 1]
    assert repeated, "the workload has repeated (FAQ) prompts"
    assert len(expanded) == len(distinct) + sum(p.repeat - 1 for p in repeated)
    assert all(p.messages[0] == ("system", p.system) for p in repeated)


def test_workload_limit_is_per_category_and_split_and_categories_filter() -> None:
    limited = load_workload(DEFAULT_WORKLOAD, limit=1)
    assert len(limited) == len({(p.split, p.category) for p in limited}) == len(
        {(p.split, p.category) for p in load_workload(DEFAULT_WORKLOAD)})
    assert {p.category for p in load_workload(DEFAULT_WORKLOAD, ["code"])} == {"code"}


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) == -1
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def _result(mode: str, tokens: list[int], wall: float, drafted: int = 0, accepted: int = 0) -> RequestResult:
    rounds = len(tokens) - 1 - accepted
    return RequestResult("p", "chat", mode, completion_tokens=len(tokens), wall_s=wall, ttft_s=0.1,
                         num_rounds=rounds, num_drafted=drafted, num_accepted=accepted, token_ids=tokens)


def test_speedup_and_mismatch_reporting() -> None:
    same = {"target": _result("target", [1, 2, 3, 4, 5], 2.0), "spec": _result("spec", [1, 2, 3, 4, 5], 1.0, 4, 2)}
    summary = summarize([same])
    assert summary["overall"]["speedup_median"] == pytest.approx(2.0)
    assert summary["overall"]["decode_speedup_median"] == pytest.approx((4 / 0.9) / (4 / 1.9))  # ttft 0.1 s
    assert summary["chat"]["spec"]["acceptance_rate"] == pytest.approx(0.5)
    assert summary["chat"]["spec"]["mean_tokens_per_round"] == pytest.approx((2 + 2) / 2)
    assert check_pairs([same]) == []
    differ = {"target": same["target"], "spec": _result("spec", [1, 2, 9, 4, 5], 1.0)}
    assert check_pairs([differ])[0]["mismatch_at"] == 2


GEO = kv.Geometry(block_size=16, bytes_per_token=100, num_blocks=1024, max_model_len=1024)


def test_waste_stays_within_one_partly_filled_block_through_rollbacks() -> None:
    seq = kv.SeqTokens(list(range(37)), kv.synthetic_output(0, 50))
    for rate in (0.0, 0.3, 1.0):
        report = kv.waste_report([seq], GEO, num_draft=4, accept_rate=rate)
        row = report["per_seq"][0]
        assert report["goal_met"] and row["max_partly_filled_blocks"] == 1
        assert row["tokens_in_kv"] == 37 + 50 - 1  # the last token has no KV yet
        assert row["waste_slots"] == row["blocks"] * 16 - row["tokens_in_kv"] < 16


def test_paged_capacity_beats_contiguous_for_short_sequences() -> None:
    seqs = [kv.SeqTokens(list(range(40)), kv.synthetic_output(0, 60))]
    report = kv.capacity_report(seqs, GEO, max_new_tokens=60)
    assert report["contiguous_max_model_len"] == 16
    assert report["paged"] == 1024 // 7  # 100 tokens -> 7 blocks
    assert report["goal_met"] and report["paged_vs_contiguous"] >= 3


def test_prefix_sharing_saves_the_shared_full_blocks_per_extra_session() -> None:
    system = list(range(1000, 1040))  # 40 tokens: 2 full blocks shared
    sessions = [system + [i, i + 100, i + 200] for i in range(4)]
    report = kv.sharing_report(sessions, output_len=20, block_size=16, counts=[1, 4])
    assert report["shared_full_blocks"] == 2
    one, four = report["rows"]
    assert one["blocks_saved"] == 0
    assert four["blocks_saved"] == 3 * 2


def test_position_acceptance_counts_only_tested_positions() -> None:
    rounds = [(4, 4, "model"), (4, 1, "model"), (2, 0, "model"), (0, 0, "none")]
    per_position = position_acceptance(rounds, 4)
    assert [(p["reached"], p["accepted"]) for p in per_position] == [(3, 2), (2, 1), (1, 1), (1, 1)]
    assert pooled_acceptance(per_position) == pytest.approx(5 / 7)


def test_analytic_speedup_matches_the_closed_form() -> None:
    assert analytic_speedup(0.0, 4, 0.0) == pytest.approx(1.0)          # nothing accepted, free draft
    assert analytic_speedup(1.0, 4, 0.0) == pytest.approx(5.0)          # all accepted, free draft
    a, g, c = 0.8, 4, 0.25
    assert analytic_speedup(a, g, c) == pytest.approx((1 - a ** 5) / ((1 - a) * 2.0))


def test_arm_speedups_pair_each_ask_with_its_prompts_target_run() -> None:
    target = {"p": _result("target", [1, 2, 3, 4, 5], 2.0)}
    asks = [_result("tiers", [1, 2, 3, 4, 5], 1.0, 4, 4), _result("tiers", [1, 2, 3, 4, 5], 0.5, 4, 4)]
    asks[1].id = "p#1"
    s = speedups(asks, target)
    assert s["n"] == 2 and s["wall_median"] == pytest.approx((2.0 + 4.0) / 2)
    assert s["aggregate"] == pytest.approx((10 / 1.5) / (10 / 4.0))


# ------------------------------------------------------------------------------------------------- issue 14 bench
def test_each_arm_asks_its_own_draft_length_and_target_runs_first() -> None:
    assert arm_k("target", 3, 6) == 0 and arm_k("sequential", 3, 6) == 3 and arm_k("sequential-k4", 3, 6) == 4
    assert arm_k("adaptive", 3, 6) == 6 and arm_k("adaptive-cold", 3, 6) == 6
    arms, na = layout_arms(["all", "sequential", "target"], {"overlap"})
    assert arms == ["target", "sequential"] and na == {"all": ["draft_tree_width", "suffix_drafting"]}
    with pytest.raises(SystemExit, match="unknown arm"):
        layout_arms(["sequentail"], set())


def test_feature_arms_are_na_until_the_gateway_has_their_fields() -> None:
    assert missing_features("sequential", set()) == [] and missing_features("target", set()) == []
    assert missing_features("all", {"overlap"}) == ["draft_tree_width", "suffix_drafting"]
    assert missing_features("tree", {"draft_tree_width"}) == []
    assert ARM_ENV["sequential"]["SPECMESH_GATEWAY_DRAFT_PREFETCH"] == "0"
    assert {k: ARM_ENV["all"][k] for k in ("SPECMESH_GATEWAY_OVERLAP", "SPECMESH_GATEWAY_DRAFT_TREE_WIDTH",
                                           "SPECMESH_GATEWAY_SUFFIX_DRAFTING")} == {
        "SPECMESH_GATEWAY_OVERLAP": "1", "SPECMESH_GATEWAY_DRAFT_TREE_WIDTH": "2",
        "SPECMESH_GATEWAY_SUFFIX_DRAFTING": "1"}


def test_layouts_pin_a_and_share_b_and_lengths_cap_prompts() -> None:
    assert dict(LAYOUTS["a"].pin) == {"verifier": "0", "draft": "1"} and LAYOUTS["a"].verifier_threads == 1
    assert LAYOUTS["b"].pin == () and LAYOUTS["b"].verifier_threads == 2
    # layout a keeps the verifier's core to the verifier: gateways, client and proxy go to the draft's core
    assert cpu_list(LAYOUTS["a"].others_cpus) == {1} and LAYOUTS["b"].others_cpus == ""
    assert cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_run_key(run_key("b", 256)) == ("b", 256)
    assert prompt_cap(64, [64, 256], 0, 1) == 0 and prompt_cap(256, [64, 256], 0, 1) == 1
    assert prompt_cap(256, [64, 256], 2, 0) == 2


def test_round_terms_split_the_round_and_name_the_limit() -> None:
    # E = 3 tokens per round at 1.5x: R = 2 target steps = 1 + D (4 * 0.25 = 1.0) + V (4 * 0 = 0) + O 0
    t = round_terms(1.5, 3.0, 4.0, 0.25, 0.0)
    assert (t["R"], t["D"], t["V"]) == (pytest.approx(2.0), pytest.approx(1.0), 0.0)
    assert t["O"] == pytest.approx(0.0) and t["bound"] == pytest.approx(1.5)
    assert t["ideal acceptance"] == pytest.approx(2.5) and t["ideal draft cost"] == pytest.approx(3.0)
    assert limiting_term(t).startswith("draft cost: D=m*c=1.00")
    suffix = round_terms(1.5, 3.0, 4.0, 0.25, 0.0, model_drafted_per_round=0.0)   # no model drafts: D = 0
    assert suffix["D"] == 0.0 and suffix["O"] == pytest.approx(1.0) and limiting_term(suffix).startswith("overhead")
    slow = round_terms(1.0, 3.0, 4.0, 0.05, 0.1)          # R = 3 = 1 + 0.2 + 0.4 + O 1.4
    assert slow["O"] == pytest.approx(1.4) and limiting_term(slow).startswith("overhead")
    hidden = round_terms(2.0, 3.0, 4.0, 0.25, 0.0)         # R = 1.5 < 1 + D: half of D ran alongside the verify
    assert hidden["hidden"] == pytest.approx(0.5) and hidden["ideal draft cost"] == pytest.approx(3.0)
    assert round_terms(0.0, 3.0, 4.0, 0.1, 0.1) == {} and limiting_term({}) == "no rounds measured"
    free = round_terms(1.0, 3.0, 4.0, 0.05, 0.1, free_tokens=4)   # 5 verified tokens, 4 free: V = 1 * 0.1
    assert free["V"] == pytest.approx(0.1) and round_terms(1.0, 3.0, 3.0, 0.05, 0.1, free_tokens=4)["V"] == 0.0


def _row(speedup: float, tok_s: float, n: int = 2) -> dict[str, Any]:
    return {"n": n, "speedup": {"decode_median": speedup}, "aggregate_tok_s": tok_s, "median_decode_tok_s": tok_s,
            "mean_tokens_per_round": 3.0, "num_rounds": 10, "num_drafted": 40}


def test_goals_pass_and_fail_with_the_limiting_term() -> None:
    target = {c: _row(1.0, 10.0) for c in ("chat", "code", "overall")}
    a = {"target": target, "sequential": {"chat": _row(1.1, 11.0), "code": _row(2.2, 22.0),
                                          "overall": _row(1.7, 17.0)}, "tree": {"overall": _row(1.2, 12.0)}}
    b = {"target": {"overall": _row(1.0, 15.0)}, "sequential": {"overall": _row(1.4, 21.0)}}
    peer = {"64": {"2": {"target": {"overall": {"tok_s": 20.0}}}}}
    goals = {g["goal"].split(",")[0]: g for g in goals_for_length({"a/64": a, "b/64": b}, 64, {"a": 0.4, "b": 0.3},
                                                                   VerifyCost(0.1), peer)}
    assert goals["(a) @64 overall decode speedup"]["passed"]
    assert goals["(a) @64 code decode speedup"]["passed"]
    chat = goals["(a) @64 chat decode speedup"]
    assert not chat["passed"] and chat["limiting"].startswith("draft cost")   # D = 4 * 0.4 = 1.6 steps
    assert goals["(b) @64 decode speedup over 2-core target-only"]["passed"]
    e2e = goals["(b) @64 end-to-end tok/s sequential / llama.cpp target-only 2 threads"]
    assert e2e["passed"] and e2e["value"] == pytest.approx(21.0 / 20.0)
    assert greedy_goal([])["passed"]
    bad = greedy_goal([{"run": "a/64", "arm": "tree", "id": "p", "mismatch_at": 3}])
    assert not bad["passed"] and bad["limiting"] == "a/64 tree"
    assert format_goal(chat).startswith("FAIL (a) @64 chat") and "limited by draft cost" in format_goal(chat)


def test_llamacpp_peer_summary_pools_and_checks_its_own_greedy_output() -> None:
    def run(pid: str, config: str, text: str, ms: float) -> PeerRun:
        return PeerRun(pid, "code", config, 2, 64, completion_tokens=10, wall_s=ms / 500, predicted_ms=ms, text=text,
                       draft_n=8 if config == "spec" else 0, draft_n_accepted=4 if config == "spec" else 0)
    runs = [run("p", "target", "abc", 1000), run("q", "target", "xyz", 1000), run("p", "spec", "abc", 500),
            run("q", "spec", "xyw", 500)]
    mark_identical(runs)
    assert [r.matches_target for r in runs] == [True, True, True, False]
    s = peer_summarize(runs)["64"]["2"]
    assert s["target"]["overall"]["decode_tok_s"] == pytest.approx(10.0)
    assert s["spec"]["code"]["speedup"] == pytest.approx(2.0) and s["spec"]["overall"]["identical_to_target"] == 1
    assert s["spec"]["overall"]["acceptance"] == pytest.approx(0.5)
    cmd = server_command("llama-server", Path("t.gguf"), Path("d.gguf"), 1, 9000)
    assert cmd[cmd.index("-md") + 1] == "d.gguf" and cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert "-md" not in server_command("llama-server", Path("t.gguf"), None, 2, 9000)
    body = chat_body(Prompt("p", "chat", "hi", "sys"), 64)
    assert body["temperature"] == 0 and body["cache_prompt"] is False and body["messages"][0]["role"] == "system"


@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset not installed")
def test_stack_config_taskset_pins_the_child_itself() -> None:
    cpu = str(max(os.sched_getaffinity(0)))
    stack = Stack(StackConfig(target="unused", draft="", taskset={"probe": cpu}), echo_output=False)
    proc = stack._spawn("probe", "timeit", {}, 0)        # runs a few seconds: long enough to look at it
    try:
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(proc.pid) != {int(cpu)} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(proc.pid) == {int(cpu)}    # taskset exec'd python: same pid, pinned
    finally:
        proc.kill()
        proc.wait()


def test_stack_config_nice_lowers_the_child_itself() -> None:
    stack = Stack(StackConfig(target="unused", draft="", nice={"probe": 7}), echo_output=False)
    proc = stack._spawn("probe", "timeit", {}, 0)
    try:
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        deadline = time.monotonic() + 30
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == expected   # nice exec'd python: same pid
    finally:
        proc.kill()
        proc.wait()


def test_speedup_prompt_selection_per_length_and_for_the_peers() -> None:
    args = speedup.parse_args(["--lengths", "64,256", "--limit", "2", "--long-limit", "1", "--long-categories",
                               "chat,code", "--peer-lengths", "64"])
    prompts = speedup.prompts_by_length(args)
    groups = Counter((p.split, p.category) for p in load_workload(DEFAULT_WORKLOAD))
    assert len(prompts[64]) == sum(min(2, n) for n in groups.values())      # --limit per category and split
    assert [(p.split, p.category) for p in prompts[256]] == [("tune", "chat"), ("tune", "code"), ("eval", "chat"),
                                                             ("eval", "code")]
    peers = speedup.peer_prompts(prompts, args, limit=1)
    assert list(peers) == [64] and len(peers[64]) == len({p.category for p in prompts[64]})
    assert speedup.parse_args(["--max-new-tokens", "16"]).length_list == [16]


def test_cost_ratio_prices_the_draft_in_the_layouts_own_target_steps() -> None:
    hf = {"64/t1": {"target": {"overall": {"tok_s": 10.0}}, "draft": {"overall": {"tok_s": 25.0}}},
          "64/t2": {"target": {"overall": {"tok_s": 2.0}}}}
    summary = {"a/64": {"target": {"overall": {"median_decode_tok_s": 12.5}}},
               "b/256": {"target": {"overall": {"median_decode_tok_s": 7.0}}},
               "b/64": {"target": {"overall": {"median_decode_tok_s": 15.0}}}}
    c = speedup.cost_ratio(hf, [LAYOUTS["a"], LAYOUTS["b"]], summary)
    assert c == {"a": pytest.approx(0.5), "b": pytest.approx(0.6)}          # shortest length's target arm
    assert speedup.cost_ratio(hf, [LAYOUTS["a"]], {}) == {"a": pytest.approx(0.4)}   # no stack: in-process target


def test_guess_gain_decodes_the_same_tokens_with_and_without_guesses(capsys) -> None:
    from bench import guess_gain

    assert guess_gain.main(["--preset", "tiny-target", "--dtype", "int8", "--max-new-tokens", "12", "--limit", "1",
                            "--categories", "code,code-edit", "--split", "tune"]) == 0
    assert "identical" in capsys.readouterr().out


def test_huge_pages_bench_times_both_arms_on_the_same_bits(capsys, tmp_path: Path, monkeypatch) -> None:
    from bench import common, huge_pages

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert huge_pages.main(["--preset", "tiny-target", "--ks", "1,4", "--context", "20", "--rounds", "2",
                            "--reps", "1", "--name", "hp.smoke"]) == 0
    out = capsys.readouterr().out
    assert "k=1 " in out and "k=4 " in out and "plain / huge" in out
    written = json.loads(next(tmp_path.glob("hp.smoke-*.json")).read_text())      # a dotted name keeps its suffix
    assert set(written["times_ms"]) == {"huge", "plain"} and len(written["times_ms"]["huge"]["4"]) == 2


def test_kernel_pool_bench_times_both_arms_and_leaves_the_pools_shared(capsys, tmp_path: Path, monkeypatch) -> None:
    from bench import common, kernel_pool
    from specmesh.engine import cpu_build

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert kernel_pool.main(["--preset", "tiny-target", "--ks", "1", "--context", "20", "--rounds", "2",
                             "--reps", "1"]) == 0
    assert "separate / shared" in capsys.readouterr().out
    written = json.loads(next(tmp_path.glob("kernel-pool-tiny-target-*.json")).read_text())
    assert set(written["times_ms"]) == {"shared", "separate"}
    assert cpu_build._pools_shared                      # the process goes on with one pool
