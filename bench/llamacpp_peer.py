"""llama.cpp's own speculative decoding on the same pair, as a peer of bench/speedup.py.

One `llama-server` per configuration (per-request speculative settings are compiled out): target-only, and
`-md DRAFT.gguf --spec-type draft-simple` at its default draft length, with the thread count of the layout. Each
workload prompt goes to `/v1/chat/completions` as chat messages (temperature 0, cache_prompt false); decode tok/s is
the server's `timings.predicted_per_second` (pooled: all predicted tokens / all predicted ms); end-to-end tok/s is
completion tokens / request wall time. Whether the speculative output is identical to its own target-only output
is checked on the text. Build: bench/README.md, "llama.cpp peer" (the sources vendored in the
llama-cpp-python==0.3.36 sdist). The binary: `--server`, else $SPECMESH_LLAMA_SERVER, else `llama-server` on PATH.

    .venv/bin/python -m bench.llamacpp_peer --server PATH/TO/llama.cpp/build/bin/llama-server --limit 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import Prompt, add_workload_args, free_port_block, load_workload, log, split_arg, split_csv

SERVER_ENV = "SPECMESH_LLAMA_SERVER"
SERVER_NAME = "llama-server"
MISSING_SERVER = (f"no llama-server binary: pass --server PATH, set ${SERVER_ENV}, or put {SERVER_NAME} on PATH")
GGUF_DIR = Path.home() / ".cache" / "specmesh" / "gguf"
GGUF_FILES = {"qwen": ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")}
CONFIGS = ("target", "spec")
START_TIMEOUT_S = 300.0


@dataclass
class PeerRun:
    prompt_id: str
    category: str
    config: str          # "target" or "spec"
    threads: int
    max_tokens: int
    completion_tokens: int = 0
    wall_s: float = 0.0
    predicted_ms: float = 0.0
    predicted_per_second: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    text: str = ""
    error: str = ""
    matches_target: bool = True


def server_path(explicit: str = "") -> str:
    """The llama-server binary: `explicit` (a path or a name on PATH), else $SPECMESH_LLAMA_SERVER, else
    `llama-server` on PATH; '' if none of them names an executable file. An explicit choice that is missing is
    not silently replaced by another one."""
    chosen = explicit or os.environ.get(SERVER_ENV, "")
    return shutil.which(chosen or SERVER_NAME) or ""


def gguf_pair(preset: str) -> tuple[Path, Path] | None:
    """(target, draft) GGUF files of a bench preset, or None when the preset has none fetched."""
    names = GGUF_FILES.get(preset)
    if not names:
        return None
    target, draft = GGUF_DIR / names[0], GGUF_DIR / names[1]
    return (target, draft) if target.is_file() and draft.is_file() else None


def server_command(server: str, target: Path, draft: Path | None, threads: int, port: int,
                   draft_max: int = 0) -> list[str]:
    cmd = [server, "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
           "-ngl", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    if draft is not None:
        cmd += ["-md", str(draft), "-ngld", "0", "-td", str(threads), "-tbd", str(threads),
                "--spec-type", "draft-simple"]
        if draft_max:
            cmd += ["--spec-draft-n-max", str(draft_max)]
    return cmd


def chat_body(prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": role, "content": text} for role, text in prompt.messages]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "stream": False}


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s")


def ask(base_url: str, prompt: Prompt, max_tokens: int, config: str, threads: int) -> PeerRun:
    run = PeerRun(prompt.id, prompt.category, config, threads, max_tokens)
    start = time.perf_counter()
    try:
        reply = _post(f"{base_url}/v1/chat/completions", chat_body(prompt, max_tokens), 3600.0)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        run.error = str(exc)
        return run
    run.wall_s = time.perf_counter() - start
    timings = reply.get("timings", {})
    run.completion_tokens = int(reply.get("usage", {}).get("completion_tokens", timings.get("predicted_n", 0)))
    run.predicted_ms = float(timings.get("predicted_ms", 0.0))
    run.predicted_per_second = float(timings.get("predicted_per_second", 0.0))
    run.draft_n, run.draft_n_accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    run.text = reply["choices"][0]["message"].get("content") or ""
    return run


def run_config(server: str, pair: tuple[Path, Path], config: str, threads: int, prompts: Sequence[Prompt],
               lengths: Sequence[int], draft_max: int = 0) -> list[PeerRun]:
    """One server for one configuration; every prompt at every length (one warm-up ask first)."""
    port = free_port_block(1)
    cmd = server_command(server, pair[0], pair[1] if config == "spec" else None, threads, port, draft_max)
    base_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: list[PeerRun] = []
    try:
        wait_healthy(base_url, proc)
        ask(base_url, prompts[0], 4, config, threads)
        for prompt in prompts:
            for length in lengths:
                runs.append(ask(base_url, prompt, length, config, threads))
                r = runs[-1]
                log(f"llama.cpp {config} t{threads} {prompt.id:<20} @{length}: {r.predicted_per_second:6.2f} tok/s"
                    + (f" drafted {r.draft_n} accepted {r.draft_n_accepted}" if config == "spec" else "")
                    + (f" ERROR {r.error}" if r.error else ""))
    finally:
        stop_server(proc)
    return runs


def mark_identical(runs: list[PeerRun]) -> None:
    """A spec run matches when its text equals the target-only text of the same prompt, threads and length."""
    reference = {(r.prompt_id, r.threads, r.max_tokens): r.text for r in runs if r.config == "target"}
    for r in runs:
        if r.config != "target":
            r.matches_target = not r.error and reference.get((r.prompt_id, r.threads, r.max_tokens)) == r.text


def _pool(runs: Iterable[PeerRun]) -> dict[str, Any]:
    rs = [r for r in runs if not r.error]
    predicted = sum(r.predicted_ms for r in rs) / 1000
    tokens, wall = sum(r.completion_tokens for r in rs), sum(r.wall_s for r in rs)
    drafted, accepted = sum(r.draft_n for r in rs), sum(r.draft_n_accepted for r in rs)
    return {"n": len(rs), "decode_tok_s": tokens / predicted if predicted else 0.0,
            "tok_s": tokens / wall if wall else 0.0, "identical_to_target": sum(r.matches_target for r in rs),
            "acceptance": accepted / drafted if drafted else 0.0, "errors": sum(bool(r.error) for r in runs)}


def summarize(runs: Sequence[PeerRun]) -> dict[str, Any]:
    """length -> threads -> config -> category (+ overall) -> pooled stats, with the speedup of decode tok/s over
    target-only on the same prompts."""
    out: dict[str, Any] = {}
    for length in sorted({r.max_tokens for r in runs}):
        for threads in sorted({r.threads for r in runs}):
            mine = [r for r in runs if r.max_tokens == length and r.threads == threads]
            by_config: dict[str, Any] = {}
            for config in dict.fromkeys(r.config for r in mine):
                rs = [r for r in mine if r.config == config]
                cats = {c: [r for r in rs if r.category == c] for c in dict.fromkeys(r.category for r in rs)}
                by_config[config] = {c: _pool(group) for c, group in {**cats, "overall": rs}.items()}
            for rows in by_config.values():
                for cat, row in rows.items():
                    base = by_config.get("target", {}).get(cat, {}).get("decode_tok_s", 0.0)
                    row["speedup"] = row["decode_tok_s"] / base if base else 0.0
            out.setdefault(str(length), {})[str(threads)] = by_config
    return out


def run_peer(server: str, preset: str, prompts: Sequence[Prompt], lengths: Sequence[int],
             threads: Sequence[int], draft_max: int = 0) -> dict[str, Any]:
    """Every configuration at every thread count; {} with a reason when the binary or GGUF files are missing."""
    pair = gguf_pair(preset)
    if not server or pair is None:
        reason = MISSING_SERVER if not server else f"no GGUF files for preset {preset} in {GGUF_DIR}"
        log(f"llama.cpp peer skipped: {reason}")
        return {"skipped": reason}
    runs: list[PeerRun] = []
    failed = []
    for t in threads:
        for config in CONFIGS:
            try:
                runs += run_config(server, pair, config, t, prompts, lengths, draft_max)
            except (RuntimeError, TimeoutError, OSError) as exc:   # the stack's results must survive a bad peer
                failed.append(f"{config} t{t}: {exc}")
                log(f"llama.cpp {config} t{t} failed: {exc}")
    mark_identical(runs)
    return {"server": server, "target": str(pair[0]), "draft": str(pair[1]), "summary": summarize(runs),
            "failed": failed, "runs": [asdict(r) for r in runs]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--server", default="", help=f"llama-server binary (default: ${SERVER_ENV}, else "
                                                f"{SERVER_NAME} on PATH)")
    p.add_argument("--preset", default="qwen", choices=sorted(GGUF_FILES))
    p.add_argument("--lengths", default="64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--draft-max", type=int, default=0, help="--spec-draft-n-max (0 = llama.cpp's default)")
    args = p.parse_args(argv)
    server = server_path(args.server)
    if not server:
        p.error(MISSING_SERVER)
    prompts = load_workload(args.workload, split_csv(args.categories), True, args.limit, split_arg(args))
    peer = run_peer(server, args.preset, prompts, [int(x) for x in split_csv(args.lengths)],
                    [int(x) for x in split_csv(args.threads)], args.draft_max)
    print(json.dumps(peer.get("summary", peer), indent=1))
    return 0 if "summary" in peer else 1


if __name__ == "__main__":
    sys.exit(main())
