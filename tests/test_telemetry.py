"""Tracing and metrics through the in-process stack: one trace per request, every hop and round, batch links,
OTLP export to a real gRPC receiver, /metrics that parses and moves, and the trace waterfall CLI."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections import Counter
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from draft_service.server import build_draft
from gateway.channels import internal_channel
from gateway.health import VerifierWatch
from gateway.replicas import VerifierPool
from protos.specmesh.v1 import common_pb2, generate_pb2_grpc, verifier_pb2_grpc
from specmesh.config import DraftConfig, EngineConfig, TelemetryConfig, VerifierConfig
from specmesh.ops import cli, client
from specmesh.telemetry.span_file import JsonLinesSpanExporter, span_to_dict
from specmesh.telemetry.tracing import add_exporter
from tests.stack import Running, slow_forwards, start_gateway
from tests.test_metric_help import bad_help
from verifier_service.server import build_verifier

PROMPT = "Speculative decoding splits work between a small draft model and"
GENERATE = "/specmesh.v1.Generation/Generate"
VERIFY = "/specmesh.v1.Verifier/Verify"
PROPOSE = "/specmesh.v1.Draft/Propose"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_config() -> TelemetryConfig:
    return TelemetryConfig(metrics_port=free_port())


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tmp_path_factory):
    memory = InMemorySpanExporter()
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    span_file = JsonLinesSpanExporter(str(trace_file))
    for exporter in (memory, span_file):          # the three services share this process's TracerProvider
        add_exporter(exporter, "specmesh-test", batch=False)
    engine = EngineConfig(kv_cache_memory_mb=16)
    # No decoding ahead: a verdict the verifier already holds would leave the gateway's prefetched draft unused,
    # and the test counts one Propose per model round.
    v_server, v_engine = build_verifier(VerifierConfig(port=0, engine=engine, telemetry=metrics_config(),
                                                       decode_ahead_tokens=0))
    verifier = Running(v_server, await v_server.start("127.0.0.1", 0), v_engine)
    d_server, d_engine = build_draft(DraftConfig(port=0, engine=EngineConfig(model="tiny-draft", kv_cache_memory_mb=16),
                                                 telemetry=metrics_config()))
    draft = Running(d_server, await d_server.start("127.0.0.1", 0), d_engine)
    # Drafts from the draft service only (no cache / n-gram tier), so every drafted round crosses that hop.
    gateway = await start_gateway(verifier.addr, draft.addr, telemetry=metrics_config(), enable_cache=False,
                                  enable_ngram=False)
    cached = await start_gateway(verifier.addr, draft.addr, enable_cache=True, enable_ngram=False)
    yield {"verifier": verifier, "draft": draft, "gateway": gateway, "cached": cached, "memory": memory,
           "trace_file": trace_file}
    for running in (cached, gateway, draft, verifier):
        await running.stop()
    memory.shutdown()
    span_file.shutdown()


async def generate(addr: str, **kwargs: Any):
    kwargs = {"max_new_tokens": 16, "ignore_eos": True, "num_draft_tokens": 3, **kwargs}
    return [r async for r in client.stream(addr, client.make_request(PROMPT, **kwargs), timeout_s=60)]


async def spans_after_cleanup(memory: InMemorySpanExporter, num_end_sessions: int = 2,
                              trace_id: str | None = None) -> list[dict[str, Any]]:
    """Finished spans once the request's asynchronous EndSession calls have been served (those of `trace_id` when
    given: work of earlier tests may still be ending in this process, in traces of its own)."""
    for _ in range(200):
        spans = [span_to_dict(s) for s in memory.get_finished_spans()]
        mine = [s for s in spans if trace_id is None or s["trace_id"] == trace_id]
        ends = [s for s in mine if s["name"].endswith("/EndSession") and s["kind"] == "SERVER"]
        if len(ends) >= num_end_sessions and any(s["name"] == "end_session" for s in mine):
            return spans
        await asyncio.sleep(0.05)
    raise AssertionError("EndSession spans never arrived")


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["span_id"]: s for s in spans}


async def test_one_trace_per_generation_with_every_hop_and_round(stack) -> None:
    memory = stack["memory"]
    memory.clear()
    responses = await generate(stack["gateway"].addr)
    usage = responses[-1].usage
    request_id = responses[0].request_id
    spans = await spans_after_cleanup(memory, trace_id=request_id)
    # The engines' batch spans: each its own trace, linked to the requests it served (this one among them).
    forwards = [s for s in spans if s["name"].endswith(" forward")
                and any(link["trace_id"] == request_id for link in s["links"])]
    # One trace, and the request id the client got is its trace id. Spans of other traces may be work of earlier
    # tests still ending in this process (the CI runner saw 15 such traces once), so the trace is checked from the
    # inside: every hop's client and server span, every round, the prefill and the cleanup must all be in it.
    request_spans = [s for s in spans if s["trace_id"] == request_id]
    assert not [s for s in request_spans if s["name"].endswith(" forward")]
    ids = by_id(request_spans)
    (root,) = [s for s in request_spans if s["parent_span_id"] is None]
    assert root["name"] == GENERATE and root["kind"] == "SERVER"
    (request,) = [s for s in request_spans if s["name"] == "text_completion tiny-target"]
    assert request["parent_span_id"] == root["span_id"]
    attrs = request["attributes"]
    assert attrs["gen_ai.request.model"] == "tiny-target"
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == 16
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    # A round span per round, children of the request, with what the client was told.
    rounds = sorted((s for s in request_spans if s["name"] == "round"),
                    key=lambda s: s["attributes"]["specmesh.round.index"])
    assert len(rounds) == usage.num_rounds
    assert all(r["parent_span_id"] == request["span_id"] for r in rounds)
    stats = [r.round for r in responses if r.round.round > 0]
    assert [(r["attributes"]["specmesh.round.drafted"], r["attributes"]["specmesh.round.accepted"])
            for r in rounds] == [(s.num_drafted, s.num_accepted) for s in stats]
    assert sum(r["attributes"]["specmesh.round.drafted"] for r in rounds) == usage.num_drafted_tokens > 0
    (prefill,) = [s for s in request_spans if s["name"] == "prefill"]
    assert prefill["parent_span_id"] == request["span_id"]
    # Every hop: each client RPC span has exactly one server span as its child, in the other service.
    clients = [s for s in request_spans if s["kind"] == "CLIENT"]
    servers = [s for s in request_spans if s["kind"] == "SERVER" and s is not root]
    assert sorted(s["name"] for s in clients) == sorted(s["name"] for s in servers)
    for server in servers:
        parent = ids[server["parent_span_id"]]
        assert parent["kind"] == "CLIENT" and parent["name"] == server["name"]
    names = Counter(s["name"] for s in clients)
    assert names[VERIFY] == usage.num_rounds
    assert names["/specmesh.v1.Verifier/EndSession"] == names["/specmesh.v1.Draft/EndSession"] == 1
    assert [s["parent_span_id"] in ids for s in request_spans if s["name"] == "end_session"] == [True]
    # One Propose per model-drafted round, plus the draft prefill that runs beside the verifier's prefill.
    model_rounds = sum(1 for r in rounds if r["attributes"]["specmesh.round.draft_source"] == "model")
    assert names[PROPOSE] == model_rounds + 1
    assert names["/specmesh.v1.Verifier/StartSession"] == 1 and model_rounds >= 1
    for c in clients:
        if c["name"] in (VERIFY, PROPOSE):
            assert ids[c["parent_span_id"]]["name"] in ("round", "prefill")
    # The verifier's batch spans (one per engine step, their own traces) link to the server span of every
    # request they served: here each StartSession / Verify call of this request.
    verify_servers = {s["span_id"] for s in servers if s["name"] in (VERIFY, "/specmesh.v1.Verifier/StartSession")}
    assert {f["name"] for f in forwards} == {"verifier-engine forward"}
    linked = {link["span_id"] for f in forwards for link in f["links"] if link["trace_id"] == request_id}
    assert linked == verify_servers
    assert all(f["parent_span_id"] is None and f["trace_id"] != request_id for f in forwards)


async def test_idle_health_probes_make_no_spans_while_a_request_still_makes_its_trace(stack) -> None:
    memory = stack["memory"]
    memory.clear()
    channel = internal_channel(stack["verifier"].addr)       # intercepted, as the gateway's own channels
    try:
        pool = VerifierPool.of_stubs([verifier_pb2_grpc.VerifierStub(channel)], [stack["verifier"].addr])
        watch = VerifierWatch(pool, _ignore, timeout_s=60.0)   # a loaded machine must not turn a probe into a failure
        for _ in range(5):                    # five seconds of an idle gateway's probing, without the waits
            await watch.probe_once()
        assert list(watch.failures.values()) == [0]
    finally:
        await channel.close()
    # (other tests' asynchronous EndSession calls may still end now: only the probes' own spans are looked for)
    assert [s.name for s in memory.get_finished_spans() if "GetModelInfo" in s.name] == []
    responses = await generate(stack["gateway"].addr)
    spans = await spans_after_cleanup(memory)
    assert GENERATE in {s["name"] for s in spans if s["trace_id"] == responses[0].request_id}
    assert not [s for s in spans if "GetModelInfo" in s["name"]]


async def _ignore(serving: bool) -> None: ...


async def test_concurrent_requests_get_their_own_traces_and_share_batches(stack, monkeypatch) -> None:
    memory = stack["memory"]
    memory.clear()
    slow_forwards(monkeypatch, stack["verifier"].engine.runner, 0.03)      # concurrent verifies queue up
    results = await asyncio.gather(*[generate(stack["gateway"].addr, max_new_tokens=24) for _ in range(4)])
    monkeypatch.undo()
    ids = {r[0].request_id for r in results}
    assert len(ids) == 4
    spans = await spans_after_cleanup(memory, num_end_sessions=8)
    requests = [s for s in spans if s["name"].startswith("text_completion")]
    assert {s["trace_id"] for s in requests} == ids
    forwards = [s for s in spans if s["name"] == "verifier-engine forward"]
    for f in forwards:
        assert len(f["links"]) == f["attributes"]["specmesh.batch.num_seqs"]
    assert max(len({link["trace_id"] for link in f["links"]}) for f in forwards) > 1   # a batch served several


async def test_client_request_id_is_kept(stack) -> None:
    request = client.make_request(PROMPT, max_new_tokens=4)
    request.request_id = "my-request-7"
    responses = [r async for r in client.stream(stack["gateway"].addr, request, timeout_s=60)]
    assert {r.request_id for r in responses} == {"my-request-7"}


def scrape(running: Running) -> dict[str, float]:
    assert running.server.metrics is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics.port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def test_every_served_metric_help_says_what_it_counts(stack) -> None:
    await generate(stack["gateway"].addr)
    families = []
    for name in ("gateway", "verifier", "draft"):
        port = stack[name].server.metrics.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            families += [(f.name, f.documentation) for f in text_string_to_metric_families(reply.read().decode())
                         if f.name.startswith("specmesh_")]
    assert {"specmesh_draft_guessed", "specmesh_verifier_ahead_tokens", "specmesh_round_outcomes_rounds"} <= {
        name for name, _ in families}
    assert bad_help(families) == []


async def test_metrics_parse_and_move_after_a_generation(stack) -> None:
    gateway, verifier, draft = stack["gateway"], stack["verifier"], stack["draft"]
    before, v_before = scrape(gateway), scrape(verifier)
    responses = await generate(gateway.addr, max_new_tokens=12)
    usage = responses[-1].usage
    with pytest.raises(grpc.aio.AioRpcError):
        [r async for r in client.stream(gateway.addr, client.make_request("   "), timeout_s=10)]
    after, v_after, d_after = scrape(gateway), scrape(verifier), scrape(draft)

    def moved(name: str, a: dict[str, float] = after, b: dict[str, float] = before) -> float:
        return a.get(name, 0.0) - b.get(name, 0.0)

    assert moved("specmesh_generation_tokens_total") == usage.completion_tokens == 12
    assert moved("specmesh_prompt_tokens_total") == usage.prompt_tokens
    assert moved("specmesh_requests_total{finish_reason=length}") == 1
    assert moved("specmesh_request_errors_total{code=INVALID_ARGUMENT}") == 1
    assert moved("specmesh_time_to_first_token_seconds_count") == 1
    assert moved("specmesh_request_duration_seconds_count") == 1
    assert moved("specmesh_inter_token_latency_seconds_count") == usage.completion_tokens - 1
    sources = ("model", "ngram", "cache")
    assert sum(moved(f"specmesh_draft_tokens_total{{source={s}}}") for s in sources) == usage.num_drafted_tokens > 0
    assert sum(moved(f"specmesh_draft_accepted_tokens_total{{source={s}}}") for s in sources) == \
        usage.num_accepted_tokens
    assert moved("specmesh_draft_position_drafted_tokens_total{position=0}") >= 1
    assert moved("specmesh_draft_length_tokens_count") == usage.num_rounds
    assert moved("specmesh_engine_forward_seconds_count", v_after, v_before) >= usage.num_rounds + 1
    assert moved("specmesh_engine_batch_size_count", v_after, v_before) >= usage.num_rounds + 1
    num_blocks = verifier.engine.block_manager.num_blocks
    assert v_after["specmesh_kv_cache_blocks_used"] + v_after["specmesh_kv_cache_blocks_free"] == num_blocks
    assert "specmesh_engine_queue_length" in v_after and "specmesh_engine_running_sessions" in d_after
    assert d_after["specmesh_engine_forward_seconds_count"] > 0


async def test_cancelled_request_is_counted_and_its_span_ends(stack) -> None:
    gateway, memory = stack["gateway"], stack["memory"]
    before = scrape(gateway)
    memory.clear()
    async with grpc.aio.insecure_channel(gateway.addr) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            client.make_request(PROMPT, max_new_tokens=400, ignore_eos=True))
        async for _ in call:
            break
        call.cancel()
    for _ in range(200):
        requests = [s for s in memory.get_finished_spans() if s.name.startswith("text_completion")]
        if requests:
            break
        await asyncio.sleep(0.05)
    (request,) = requests
    assert request.status.status_code.name == "ERROR" and request.status.description.startswith("CANCELLED")
    assert scrape(gateway).get("specmesh_request_errors_total{code=CANCELLED}", 0) - \
        before.get("specmesh_request_errors_total{code=CANCELLED}", 0) == 1


async def test_trace_cli_prints_the_request_waterfall(stack, capsys) -> None:
    stack["memory"].clear()
    responses = await generate(stack["gateway"].addr)
    await spans_after_cleanup(stack["memory"])
    assert responses[0].request_id in stack["trace_file"].read_text()
    assert cli.main(["trace", "show", "--file", str(stack["trace_file"]), "--last"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("trace ")
    assert any(line.startswith(GENERATE) for line in lines), out              # the root, unindented
    assert any("└─ text_completion tiny-target" in line for line in lines)
    assert any("├─ round" in line or "└─ round" in line for line in lines)
    assert any("⇢ verifier-engine forward" in line for line in lines)    # linked batch spans under the RPC
    assert all(" ms" in line or " s " in line for line in lines[1:])
    trace_id = lines[0].split()[1]
    assert trace_id == responses[0].request_id
    assert cli.main(["trace", "show", "--file", str(stack["trace_file"]), "--trace-id", trace_id]) == 0
    assert capsys.readouterr().out == out
    assert cli.main(["trace", "show", "--file", str(stack["trace_file"]), "--trace-id", "0" * 32]) == 1


async def test_cache_lookups_are_spans_of_their_round(stack) -> None:
    """The draft cache is a hop too: a cache_lookup span under the round that asked, with how much it drafted."""
    memory = stack["memory"]
    metadata = (("x-specmesh-tenant", "telemetry-cache"),)
    request = client.make_request(PROMPT, max_new_tokens=16, ignore_eos=True, num_draft_tokens=3)
    for _ in range(2):                              # the second ask finds the first one's continuation cached
        memory.clear()
        async with grpc.aio.insecure_channel(stack["cached"].addr) as channel:
            responses = [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request,
                                                                                              metadata=metadata)]
        spans = await spans_after_cleanup(memory)
    ids = by_id(spans)
    lookups = [s for s in spans if s["name"] == "cache_lookup"]
    assert lookups and all(ids[s["parent_span_id"]]["name"] == "round" for s in lookups)
    assert {s["trace_id"] for s in lookups} == {responses[0].request_id}
    cache_rounds = [r.round for r in responses if r.round.draft_source == common_pb2.DRAFT_SOURCE_CACHE]
    assert cache_rounds and sum(s["attributes"]["specmesh.cache.draft_tokens"] > 0 for s in lookups) == \
        len(cache_rounds)
