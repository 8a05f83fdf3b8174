"""The cores a one-host stack gives its verifier and its draft service.

`specmesh up` runs the verifier and the draft service on one host, one torch thread each by default. The draft
service is busy only while it drafts: under load the gateway's cost model drafts almost nothing (issue 27), and
between drafts at one stream it waits for the verifier. A verifier held to one thread then leaves the other cores
idle while prompts prefill and batched verifies run compute-bound. So the launcher lets the verifier's steps run on
every core it may use (its `taskset` list, else the launcher's own affinity).

Measured on a 2-core Zen 3 (AVX2; `python -m bench.concurrency --start-stack --preset qwen --only throughput
--streams 1,4,8 --num-requests 16 --max-new-tokens 64`), target-only tok/s at 1 / 4 / 8 streams: 16.2 / 37.5 / 41.2
on one thread, 19.2 / 52.0 / 62.6 with every step on both cores; the defaults 17.2 / 32.8 / 40.3 against 20.1 /
47.1 / 59.3. The int4 kernel's thread pool hands out its work in chunks that any thread claims, so a step that shares
a core with a draft forward slows by that forward's share, not by a whole step.

Where the two services may run on the same cores, they take turns on all of them (`draft_threads_env`): the draft
service drafts on every core it may use and does not draft the next block ahead while the verifier verifies, and the
verifier does not decode ahead for a session while its caller drafts with the model. One stream of the real pair on
a 2-core Intel (int4; `python -m bench.concurrency --start-stack --preset qwen --only throughput --streams 1,1
--num-requests 12 --max-new-tokens 64`): a model round of 4 drafts took 200 ms overlapped (the draft on one thread
beside a one-thread ahead step, Propose 120-230 ms; the Verify of 5 rows ~105 ms beside the draft service drafting
ahead) and 141 ms taking turns (Propose 77 ms, Verify 62 ms): 45 ms a token against 52 for an undrafted round. Where
they are pinned apart, each keeps its own cores and works ahead of the other.

A draft model computing on those cores takes from every stream's forwards: the gateway is told how much
(SPECMESH_GATEWAY_DRAFT_HOST_SHARE = the draft's threads over the verifier's cores, where their cores overlap), and
prices a draft model round by the other streams' tokens it costs (gateway/suffix_choice.py, `contention`).

A variable the user set (SPECMESH_VERIFIER_NUM_THREADS_MAX, ..._MAX_THREADS_MIN_TOKENS,
..._DECODE_AHEAD_BESIDE_DRAFTS, SPECMESH_DRAFT_NUM_THREADS, ..._DRAFT_AHEAD, SPECMESH_GATEWAY_DRAFT_HOST_SHARE) wins;
a verifier pinned to one core keeps one thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def cpu_list(spec: str) -> set[int]:
    """A `taskset -c` cpu list ("1", "0-1,3") as a set of cpu numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cores(taskset: str = "") -> set[int]:
    """The cpus a child started under `taskset -c <taskset>` ("" = not pinned: this process's own) may run on."""
    return cpu_list(taskset) if taskset else os.sched_getaffinity(0)


def num_cores(taskset: str = "") -> int:
    return len(cores(taskset))


def verifier_threads_env(num_threads: int, cores: int, shares_cores_with_draft: bool,
                         user_env: Mapping[str, str]) -> dict[str, str]:
    """The verifier's thread variables: `num_threads` for every step, raised to `cores` for every step when there
    are more cores than that; where the draft service may run on the same cores, no decoding ahead for a session
    while its caller drafts with the model (the draft takes every core then). Variables in `user_env` (the user's
    environment) are left to it."""
    env = {"SPECMESH_VERIFIER_NUM_THREADS": str(num_threads)}
    raised: dict[str, str] = {}
    if cores > num_threads:
        raised = {"SPECMESH_VERIFIER_NUM_THREADS_MAX": str(cores), "SPECMESH_VERIFIER_MAX_THREADS_MIN_TOKENS": "1"}
    if shares_cores_with_draft:
        raised["SPECMESH_VERIFIER_DECODE_AHEAD_BESIDE_DRAFTS"] = "false"
    return env | {name: value for name, value in raised.items() if name not in user_env}


def shares_cores(verifier_taskset: str, draft_taskset: str) -> bool:
    """Whether the verifier and the draft service may run on the same cores (neither pinned, or pinned to cpus they
    share)."""
    return bool(cores(verifier_taskset) & cores(draft_taskset))


def draft_threads_env(num_threads: int, verifier_taskset: str, draft_taskset: str,
                      user_env: Mapping[str, str]) -> dict[str, str]:
    """The draft service's threads and drafting ahead: where it may run on the verifier's cores, every core it may
    use (at least `num_threads`) and no drafting of the next block while the verifier verifies (the two take turns);
    elsewhere `num_threads`, drafting ahead. Variables in `user_env` are left to it."""
    env = {"SPECMESH_DRAFT_NUM_THREADS": str(num_threads)}
    if shares_cores(verifier_taskset, draft_taskset):
        env = {"SPECMESH_DRAFT_NUM_THREADS": str(max(num_threads, len(cores(draft_taskset)))),
               "SPECMESH_DRAFT_DRAFT_AHEAD": "false"}
    return {name: value for name, value in env.items() if name not in user_env}


def draft_host_share_env(draft_threads: int, verifier_taskset: str, draft_taskset: str,
                         user_env: Mapping[str, str]) -> dict[str, str]:
    """The gateway's SPECMESH_GATEWAY_DRAFT_HOST_SHARE: the draft's threads over the verifier's cores where the two
    services may run on the same cores (neither pinned, or pinned to cpus they share); nothing where they may not
    (the default 0), or where the user set it."""
    name = "SPECMESH_GATEWAY_DRAFT_HOST_SHARE"
    if name in user_env or not shares_cores(verifier_taskset, draft_taskset):
        return {}
    return {name: f"{min(1.0, draft_threads / len(cores(verifier_taskset))):.3g}"}
