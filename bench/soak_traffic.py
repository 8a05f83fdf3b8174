"""Traffic of a soak run: prompts near the context limit beside short ones, greedy and sampled, random draft
lengths 0..8, client cancels, short deadlines, and fixed greedy prompts re-asked to check the output never changes.

Long prompts are `#<8 digits>\\n` + a repeated sentence; digits are one token each in Qwen2-style tokenizers, so a
fresh random head (no prefix-cache hit, a real chunked prefill) keeps the token count measured at calibration."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc

from bench.common import log
from bench.soak_report import CLIENT_CANCEL, GreedyChecks, Outcome
from protos.specmesh.v1 import generate_pb2, generate_pb2_grpc
from specmesh.ops import client

SHORT_PROMPTS = ("The quick brown fox", "def merge_sort(xs):", "سلام، امروز هوا چطور است؟",
                 "Explain paged attention.", "SELECT name FROM users WHERE", "Once upon a time",
                 "日本語で自己紹介してください。", "import numpy as np\n")
BODY_UNIT = "The verifier checks every drafted token against the target model and keeps the longest valid prefix.\n"
FIXED_HEAD = "#00000000"
GAPS = (8, 24, 56)                        # room left for new tokens after each long prompt
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000))
# The soak's gateway has API keys (bench/soak_scenarios.py: tenants with quotas); the mixed traffic uses this one.
TRAFFIC_KEY = "soak-traffic"
METADATA = (("authorization", f"Bearer {TRAFFIC_KEY}"),)
CHECK_SHORT = "check-short"
CHECK_LONG = "check-long"


@dataclass(frozen=True)
class LongPrompt:
    units: int            # repetitions of BODY_UNIT
    pad: int              # extra digits in the head (one token each): fine-tunes the length
    prompt_tokens: int    # measured through the gateway


@dataclass(frozen=True)
class Mix:
    max_model_len: int
    long_prompts: tuple[LongPrompt, ...]
    long_frac: float = 0.3
    check_frac: float = 0.1
    sampled_frac: float = 0.4
    cancel_prob: float = 0.15
    deadline_prob: float = 0.1
    timeout_s: float = 300.0


@dataclass
class Spec:
    kind: str
    request: generate_pb2.GenerateRequest
    timeout_s: float
    short_deadline: bool = False
    cancel_after: int | None = None       # close the stream after this many responses


def long_text(units: int, pad: int, unique: bool, rng: random.Random) -> str:
    head = f"#{rng.randrange(10**8):08d}" if unique else FIXED_HEAD
    return head + "7" * pad + "\n" + BODY_UNIT * units


async def prompt_tokens(stub: generate_pb2_grpc.GenerationStub, text: str) -> int:
    reply = await stub.Complete(client.make_request(text, max_new_tokens=1, num_draft_tokens=0), timeout=600,
                                metadata=METADATA)
    return reply.usage.prompt_tokens


async def calibrate(addr: str, max_model_len: int) -> tuple[LongPrompt, ...]:
    """Long prompts leaving exactly GAPS tokens of room (token counts measured through the public API)."""
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        one = await prompt_tokens(stub, long_text(1, 0, True, rng))
        per_unit = await prompt_tokens(stub, long_text(2, 0, True, rng)) - one
        prompts = []
        for gap in GAPS:
            target = max_model_len - gap
            units = max(1, 1 + (target - one) // per_unit)
            while units > 1 and one + (units - 1) * per_unit > target:
                units -= 1
            pad = target - await prompt_tokens(stub, long_text(units, 0, True, rng))
            measured = await prompt_tokens(stub, long_text(units, max(0, pad), True, rng))
            if measured != target:
                raise SystemExit(f"a long prompt came out at {measured} tokens, not {target}: this tokenizer does not "
                                 "make one token per digit; the near-limit mix cannot be exact")
            prompts.append(LongPrompt(units, max(0, pad), measured))
    log("long prompts: " + ", ".join(f"{p.prompt_tokens} tokens (+{max_model_len - p.prompt_tokens} room)"
                                     for p in prompts))
    return tuple(prompts)


def next_spec(mix: Mix, rng: random.Random) -> Spec:
    """One request of the mix."""
    k = rng.randint(0, 8)
    roll = rng.random()
    if roll < mix.check_frac:
        return check_spec(mix, rng, k)
    sampled = rng.random() < mix.sampled_frac
    sampling = {"temperature": rng.choice([0.6, 0.8, 1.0]), "top_p": rng.choice([0.0, 0.8, 0.95]),
                "seed": rng.randrange(10**6)} if sampled else {}
    if roll < mix.check_frac + mix.long_frac:
        lp = rng.choice(mix.long_prompts)
        room = mix.max_model_len - lp.prompt_tokens
        request = client.make_request(long_text(lp.units, lp.pad, rng.random() < 0.5, rng), num_draft_tokens=k,
                                      max_new_tokens=max(1, room - rng.randint(0, 3)), ignore_eos=rng.random() < 0.7,
                                      **sampling)
        kind = "long"
    else:
        request = client.make_request(rng.choice(SHORT_PROMPTS), max_new_tokens=rng.randint(8, 64),
                                      num_draft_tokens=k, ignore_eos=rng.random() < 0.5, **sampling)
        kind = "short"
    short_deadline = rng.random() < mix.deadline_prob
    timeout_s = rng.uniform(0.2, 3.0) if short_deadline else mix.timeout_s
    cancel_after = rng.randint(1, 8) if rng.random() < mix.cancel_prob else None
    return Spec(kind, request, timeout_s, short_deadline, cancel_after)


def check_spec(mix: Mix, rng: random.Random, k: int) -> Spec:
    """A fixed greedy prompt (short, or long and ending exactly at the context limit) with a random draft length."""
    if rng.random() < 0.5:
        return Spec(CHECK_SHORT, client.make_request("def fibonacci(n):", max_new_tokens=32, ignore_eos=True,
                                                     num_draft_tokens=k), mix.timeout_s)
    lp = mix.long_prompts[len(mix.long_prompts) // 2]
    return Spec(CHECK_LONG, client.make_request(long_text(lp.units, lp.pad, False, rng), ignore_eos=True,
                                                max_new_tokens=mix.max_model_len - lp.prompt_tokens,
                                                num_draft_tokens=k), mix.timeout_s)


async def run_one(stub: generate_pb2_grpc.GenerationStub, spec: Spec, greedy: GreedyChecks,
                  outcomes: list[Outcome]) -> Outcome:
    """One request; its outcome is appended to `outcomes` even when the task is cancelled at the end of the run."""
    outcome = Outcome(spec.kind, "OK", time.monotonic(), 0.0, spec.short_deadline)
    token_ids: list[int] = []
    call = stub.Generate(spec.request, timeout=spec.timeout_s, metadata=METADATA)
    try:
        responses = 0
        async for response in call:
            token_ids.extend(response.token_ids)
            responses += 1
            if spec.cancel_after is not None and responses >= spec.cancel_after and not response.finish_reason:
                call.cancel()
                outcome.code = CLIENT_CANCEL
                break
    except grpc.aio.AioRpcError as exc:
        outcome.code, outcome.details = exc.code().name, exc.details() or ""
    except asyncio.CancelledError:
        call.cancel()
        outcome.code = CLIENT_CANCEL
        raise
    finally:
        outcome.ended_s = time.monotonic()
        outcome.tokens = len(token_ids)
        outcomes.append(outcome)
    if outcome.code == "OK" and spec.kind.startswith("check"):
        greedy.record(spec.kind, spec.request.num_draft_tokens, token_ids)
    return outcome


async def worker(addr: str, mix: Mix, seed: int, stop: asyncio.Event, outcomes: list[Outcome],
                 greedy: GreedyChecks) -> None:
    """Requests one after another until `stop`; the channel reconnects to a restarted gateway on its own."""
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(addr, options=list(CHANNEL_OPTIONS)) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            outcome = await run_one(stub, next_spec(mix, rng), greedy, outcomes)
            if outcome.code not in ("OK", CLIENT_CANCEL, "DEADLINE_EXCEEDED"):
                await asyncio.sleep(0.5)   # e.g. the gateway is restarting: do not spin
