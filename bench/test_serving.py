"""The serving benchmark (bench/serving.py) on the tiny stack with tiny arguments: the traffic mix, the open-loop
run of both stack configurations over gRPC, the SSE client against the gateway's OpenAI-compatible edge (the
protocol llama-server speaks), the report's fields. Measures nothing: the figures come from real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench import serving
from bench.common import Prompt
from bench.serving_clients import StreamResult, http_sender, percentile, run_open_loop, summarize
from bench.serving_mix import TrafficRequest, arrivals, build_traffic, load_lengths
from bench.serving_peer import find_server, server_command
from gateway.openai_http import ServedModel, start_openai_http
from specmesh.models import resolve_model_dir
from tests.stack import start_draft, start_gateway, start_verifier

CHATS = [Prompt("c1", "chat", "Why is the sky blue?"), Prompt("c2", "chat", "Name three prime numbers, please.")]
SUMMARY_FIELDS = {"requests", "errors", "completion_tokens", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                  "itl_p50_s", "itl_p99_s", "max_stall_s", "max_stall_request", "ttft_p50_s_by_kind"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny-target")))


def test_the_committed_lengths_are_mostly_short_chat_with_some_documents() -> None:
    lengths = load_lengths()
    prompts = sorted(p for p, _ in lengths)
    assert len(lengths) == 1000 and prompts[len(prompts) // 2] < 100
    assert 0.03 < sum(p >= 1000 for p in prompts) / len(prompts) < 0.2


def test_arrivals_are_seeded_poisson(tokenizer) -> None:
    times = arrivals(2000, 4.0, seed=1)
    assert times == arrivals(2000, 4.0, seed=1) and times[0] == 0.0 and times == sorted(times)
    assert (times[-1] / (len(times) - 1)) == pytest.approx(0.25, rel=0.1)           # mean gap 1 / rate
    with pytest.raises(ValueError, match="rate"):
        arrivals(3, 0.0, seed=1)


def test_the_mix_builds_chats_and_documents_of_the_drawn_lengths(tokenizer) -> None:
    traffic = build_traffic(12, 0, tokenizer, CHATS, max_prompt_tokens=300, max_output_tokens=16,
                            lengths=[(5, 400), (250, 3)])
    assert {r.kind for r in traffic} == {"chat", "document"}
    for r in traffic:
        text = r.messages[-1][1]
        if r.kind == "document":
            assert abs(len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 250) <= 8
            assert r.max_tokens == 3 and text.endswith("Summarize the document above in a few sentences.")
        else:
            assert text in {c.prompt for c in CHATS} and r.max_tokens == 16             # capped
    assert traffic == build_traffic(12, 0, tokenizer, CHATS, 300, 16, lengths=[(5, 400), (250, 3)])


def test_latency_terms_from_message_times() -> None:
    a = StreamResult("a", "chat", "spec", 0.0, 4, sent_s=0.0, end_s=1.0, completion_tokens=4,
                     messages=[(0.1, 1), (0.5, 2), (0.6, 1)])
    b = StreamResult("b", "chat", "spec", 0.0, 2, sent_s=0.5, end_s=2.0, completion_tokens=2,
                     messages=[(0.2, 1), (1.5, 1)])
    s = summarize([a, b, StreamResult("c", "chat", "spec", 0.0, 1, error="UNAVAILABLE: x")])
    assert s["errors"] == 1 and s["completion_tokens"] == 6 and s["throughput_tok_s"] == pytest.approx(3.0)
    assert s["max_stall_s"] == pytest.approx(1.3) and s["max_stall_request"] == "b"
    # ITL samples: a's 0.4 s message of 2 tokens gives 0.2 twice, then 0.1; b: 1.3
    assert s["itl_p50_s"] == pytest.approx(0.2) and percentile([0.2, 0.2, 0.1, 1.3], 99) == s["itl_p99_s"]
    assert s["ttft_p50_s"] == pytest.approx(0.15)


def test_each_run_opens_its_prompts_with_its_own_tag() -> None:
    """--cache cold: no run meets another's prompts in the prefix cache, so later rates and the second configuration
    of a rate are not flattered by the first; the rest of each request is unchanged."""
    chat = TrafficRequest("r0-chat", "chat", [("system", "Be brief."), ("user", "Hi")], 5, 4)
    a, b = serving.salted([chat], "run 1 spec")[0], serving.salted([chat], "run 1 target")[0]
    assert a.messages[0] == ("system", "[run 1 spec] Be brief.") and a.messages[1:] == chat.messages[1:]
    assert a.messages != b.messages and (a.id, a.max_tokens) == (chat.id, chat.max_tokens)
    assert serving.check_exact([{"rate": 1.0, "config": c, "results": []} for c in ("target", "spec")],
                               compare=False) == []


def test_no_binary_means_no_peer(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECMESH_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_server() == ""
    with pytest.raises(SystemExit, match="not found"):
        find_server(str(tmp_path / "missing"))
    cmd = server_command("/x/llama-server", Path("/m.gguf"), 2, 8080, cpus="0,1")
    assert cmd[:3] == ["taskset", "-c", "0,1"] and cmd[cmd.index("-np") + 1] == "4" and "--cont-batching" in cmd


async def test_a_tiny_run_reports_every_field(tokenizer, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(serving, "result_paths", lambda name: (tmp_path / f"{name}.json", tmp_path / f"{name}.png"))
    verifier = await start_verifier(decode_ahead_tokens=4)
    draft = await start_draft()
    gateway = await start_gateway(verifier.addr, draft.addr, adaptive_draft_length=True, enable_ngram=True)
    http = await start_openai_http(ServedModel("tiny-target", 1024, 0), "127.0.0.1", 0, lambda: gateway.addr)
    try:
        traffic = build_traffic(3, 0, tokenizer, CHATS, 200, 6, lengths=[(5, 6), (5, 4)]) + \
            build_traffic(1, 0, tokenizer, CHATS, 200, 6, lengths=[(150, 5)])        # 3 chats, 1 document
        rows = await serving.run_stack(gateway.addr, ["target", "spec"], traffic, [8.0, 32.0], seed=0,
                                       cache="shared")
        send, close = http_sender(f"http://127.0.0.1:{http.port}")
        try:
            sse, _ = await run_open_loop(send, traffic[:2], [0.0, 0.01], "llama-server")
        finally:
            await close()
    finally:
        await http.close()
        for running in (gateway, draft, verifier):
            await running.stop()
    assert serving.check_exact(rows) == []                   # greedy: the defaults' tokens are target-only's
    assert [r.completion_tokens for r in sse] == [t.max_tokens for t in traffic[:2]]     # from the usage chunk
    assert all(r.messages and not r.error for r in sse)
    args = serving.parse_args(["--rates", "8,32", "--num-requests", "4", "--name", "tiny-serving"])
    path = serving.write_report(args, {"args": {}}, traffic, rows, {"skipped": "no llama-server binary"}, [], 1.0)
    report = json.loads(path.read_text())
    assert report["mix"]["requests"] == 4 and report["mix"]["documents"] == 1
    assert report["peer"] == {"skipped": "no llama-server binary"} and report["problems"] == []
    assert {(r["rate"], r["config"]) for r in report["rows"]} == {(8.0, "target"), (8.0, "spec"),
                                                                (32.0, "target"), (32.0, "spec")}
    for row in report["rows"]:
        assert set(row["summary"]) >= SUMMARY_FIELDS and row["summary"]["errors"] == 0
        assert row["summary"]["completion_tokens"] == sum(t.max_tokens for t in traffic)
        assert row["summary"]["throughput_tok_s"] > 0 and row["summary"]["ttft_p99_s"] >= row["summary"]["ttft_p50_s"]
        assert len(row["requests"]) == 4 and all(q["completion_tokens"] == q["max_tokens"] for q in row["requests"])


def test_only_specmesh_s_problems_fail_the_run() -> None:
    """The peer's errors are in the report; the exit code says whether specmesh erred or changed its output."""
    def row(config: str, error: str = "") -> dict[str, object]:
        return {"rate": 0.2, "config": config,
                "results": [StreamResult("r0-chat", "chat", config, 0.0, 4, error=error)]}
    peer_failed = serving.check_exact([row("target"), row(serving.PEER, "ServerDisconnectedError")], compare=False)
    assert [p["config"] for p in peer_failed] == [serving.PEER] and serving.specmesh_problems(peer_failed) == []
    ours_failed = serving.check_exact([row("spec", "UNAVAILABLE: verifier: gone"), row(serving.PEER)], compare=False)
    assert [p["config"] for p in serving.specmesh_problems(ours_failed)] == ["spec"]
