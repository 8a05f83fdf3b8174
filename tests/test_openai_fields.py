"""Every OpenAI request field either has its effect or is a 400 naming it (gateway/openai_fields.py): the parsers'
verdict for each field, and through the HTTP edge the fields that reach the engines (their 200s and the verifier's
refusal relayed with the OpenAI field name)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.openai_protocol import ApiError, parse_chat, parse_completion
from tests.test_http_edge import CHAT, OK, edge  # noqa: F401  (the HTTP edge fixture)

PROMPT = {"model": "m", "prompt": "hi"}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# (id, chat?, extra fields, the `param` of the 400, words of its message)
REFUSED = [
    ("json-object", True, {"response_format": {"type": "json_object"}}, "response_format",
     "'response_format' \"json_object\" is not supported: this server has no constrained decoding"),
    ("json-schema", True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "json_schema"),
    ("response-format-string", True, {"response_format": "json"}, "response_format", "text"),
    ("tools", True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ("tool-choice-auto", True, {"tool_choice": "auto"}, "tool_choice", '"none"'),
    ("tool-choice-required", True, {"tool_choice": "required"}, "tool_choice", "tools"),
    ("functions", True, {"functions": [{"name": "f"}]}, "functions", "tools"),
    ("function-call", True, {"function_call": "auto"}, "function_call", "tools"),
    ("parallel-tool-calls", True, {"parallel_tool_calls": True}, "parallel_tool_calls", "not supported"),
    ("logit-bias-key", False, {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("logit-bias-value", False, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("logit-bias-bool", True, {"logit_bias": {"5": True}}, "logit_bias", "[-100, 100]"),
    ("logit-bias-list", True, {"logit_bias": [5]}, "logit_bias", "dict"),
    ("min-p-range", False, {"min_p": 1.5}, "min_p", "[0, 1]"),
    ("repetition-penalty-zero", True, {"repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ("presence-penalty", False, {"presence_penalty": 0.5}, "presence_penalty", "repetition_penalty"),
    ("frequency-penalty", True, {"frequency_penalty": -1}, "frequency_penalty", "repetition_penalty"),
    ("n", True, {"n": 2}, "n", "n=1"),
    ("best-of", False, {"best_of": 3}, "best_of", "best_of=1"),
    ("logprobs", True, {"logprobs": True}, "logprobs", "log-probabilities"),
    ("logprobs-int", False, {"logprobs": 2}, "logprobs", "log-probabilities"),
    ("top-logprobs", True, {"top_logprobs": 3}, "top_logprobs", "log-probabilities"),
    ("echo", False, {"echo": True}, "echo", "echo"),
    ("suffix", False, {"suffix": "x"}, "suffix", "suffix"),
    ("user-int", True, {"user": 5}, "user", "str"),
    ("unknown", False, {"foo": 1}, "foo", "not supported"),
    ("unknown-chat", True, {"web_search_options": {}}, "web_search_options", "not supported"),
    ("chat-field-on-completions", False, {"response_format": {"type": "text"}}, "response_format",
     "not supported"),
    ("stream-options", True, {"stream": True, "stream_options": {"include_usage": True, "foo": True}},
     "stream_options.foo", "not supported"),
    ("stream-options-type", True, {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "bool"),
    ("stream-options-unstreamed", False, {"stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ("message-name", True, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name",
     "not supported"),
    ("message-tool-calls", True, {"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]},
     "messages[0].tool_calls", "not supported"),
]


def parse(chat: bool, extra: dict[str, Any]) -> Any:
    return parse_chat({**MESSAGES, **extra}) if chat else parse_completion({**PROMPT, **extra})


@pytest.mark.parametrize(("chat", "extra", "param", "words"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_fields_name_their_param(chat: bool, extra: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(chat, extra)
    assert info.value.status == 400 and info.value.param == param, info.value.body()
    assert words in info.value.message


def test_accepted_fields_reach_the_request() -> None:
    parsed = parse(True, {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "user": "u1",
                          "min_p": 0.1, "repetition_penalty": 1.2, "logit_bias": {"5": -3, "17": 2.5},
                          "top_k": 8, "seed": 3, "temperature": 0.7, "refusal": None,
                          "stream_options": {"include_usage": True}, "stream": True, "logprobs": False})
    s = parsed.request.sampling
    assert (round(s.min_p, 6), round(s.repetition_penalty, 6), s.top_k, s.seed) == (0.1, 1.2, 8, 3)
    assert dict(s.logit_bias) == {5: -3.0, 17: 2.5}
    assert parsed.include_usage and parsed.stream
    assert parse(False, {}).request.sampling.repetition_penalty == 0          # unset: off


async def test_penalty_and_bias_over_http_change_the_output(edge) -> None:  # noqa: F811
    session = edge["session"]

    async def completion(**extra: Any) -> dict[str, Any]:
        async with session.post("/v1/completions", json={**OK, "max_tokens": 6, "ignore_eos": True, **extra}) as r:
            return {"status": r.status, **(await r.json())}

    plain = await completion()
    forced = await completion(logit_bias={"42": 100})
    assert plain["status"] == forced["status"] == 200
    assert forced["choices"][0]["text"] != plain["choices"][0]["text"]
    penalised = await completion(repetition_penalty=3.0, min_p=0.2, user="someone")
    assert penalised["status"] == 200
    chat = {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none"}
    async with session.post("/v1/chat/completions", json=chat) as r:
        assert r.status == 200
    out_of_vocab = await completion(logit_bias={str(10**6): 1})      # refused by the gateway, relayed to HTTP
    assert out_of_vocab["status"] == 400 and out_of_vocab["error"]["param"] == "logit_bias"
    assert "not in the vocabulary" in out_of_vocab["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_continuous_usage_stats_on_every_chunk(edge, chat: bool) -> None:  # noqa: F811
    """guidellm asks for it on every stream: each chunk carries the usage so far, the last chunk the final one."""
    path, base = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", OK)
    request = {**base, "max_tokens": 6, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with edge["session"].post(path, json=request) as r:
        assert r.status == 200
        lines = [line.strip() for line in (await r.text()).splitlines() if line.strip()]
    chunks = [json.loads(line[len("data: "):]) for line in lines if line != "data: [DONE]"]
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    per_chunk = [c["usage"] for c in chunks[:-1]]
    assert per_chunk and all(u["prompt_tokens"] == final["prompt_tokens"] for u in per_chunk)
    counts = [u["completion_tokens"] for u in per_chunk]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in per_chunk)


def test_load_generator_bodies_parse() -> None:
    """The bodies guidellm 0.8.1 and aiperf 0.13.0 send (their request builders, read from the wheels), which
    tests/test_load_tools.py runs unmodified when their venvs exist."""
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    guidellm_text = {"model": "m", **stream, "max_tokens": 8, "stop": None, "ignore_eos": True, "prompt": "hi"}
    guidellm_chat = {"model": "m", **stream, "max_completion_tokens": 8, "stop": None, "ignore_eos": True,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    aiperf_chat = {"messages": [{"role": "user", "content": "hi"}], "model": "m", "stream": True,
                   "max_completion_tokens": 8, "ignore_eos": True, "stream_options": {"include_usage": True}}
    assert parse_completion(guidellm_text).continuous_usage
    assert parse_chat(guidellm_chat).request.max_new_tokens == 8
    assert parse_chat(aiperf_chat).include_usage
