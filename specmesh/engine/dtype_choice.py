"""`dtype = "auto"`: the fastest batch-invariant numerics this CPU runs (int4 where its kernel builds, else int8,
else float32), with the reason, so a service and `specmesh up` can say at start which numerics they run and why.

Every choice keeps greedy speculation exact (README: "Numerics and exactness"); only speed and the agreement with
the float32 model differ. The tiny random-weight presets stay on float32 under "auto": they are instant anyway, and
their outputs are then the same on every machine (the tests rely on that). The probes are injectable, so the choice
logic is testable without a compiler or a particular CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from specmesh.config import AUTO_DTYPE
from specmesh.models.catalog import TINY_PRESETS

ISA_NAMES = {"avx2": "AVX2", "avx512vnni": "AVX-512 VNNI", "amx": "AMX"}

Probe = Callable[[], str]
"""Returns what makes a kernel usable (e.g. "AVX-512 VNNI"); raises with the reason when it is not."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str       # float32, int8 or int4 (or whatever was configured explicitly)
    reason: str      # why, for the start-up line

    def describe(self, who: str) -> str:
        """e.g. 'verifier dtype int4 (int4 kernel built for AVX-512 VNNI)'."""
        return f"{who} dtype {self.dtype} ({self.reason})"


def probe_int4() -> str:
    """Builds (once, cached) and loads the int4 kernel; the instruction set it runs with."""
    from specmesh.engine import int4_kernel

    return ISA_NAMES.get(int4_kernel.instruction_set(), int4_kernel.instruction_set())


def probe_int8() -> str:
    """One batch-invariant int8 linear on a tiny input: torch's quantized engine must have the ops."""
    import torch

    from specmesh.engine.int8_linear import Int8PerTokenLinear

    with warnings.catch_warnings():   # torch's deprecation notice for quantized tensors: said again at load time
        warnings.simplefilter("ignore")
        Int8PerTokenLinear(torch.nn.Linear(32, 8, bias=False))(torch.ones(2, 32))
    return f"torch quantized engine {torch.backends.quantized.engine}"


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def resolve_dtype(requested: str, model: str, int4: Probe = probe_int4, int8: Probe = probe_int8) -> DtypeChoice:
    """The numerics to run `model` with: `requested` itself unless it is "auto"."""
    if requested != AUTO_DTYPE:
        return DtypeChoice(requested, "as configured")
    if model in TINY_PRESETS:
        return DtypeChoice("float32", "auto: tiny random-weight model, float32 gives the same tokens on every machine")
    try:
        return DtypeChoice("int4", f"auto: int4 kernel built for {int4()}")
    except Exception as exc:  # noqa: BLE001 -- any failure to build or run the kernel means: the next best
        no_int4 = f"int4 kernel unavailable: {_why(exc)}"
    try:
        return DtypeChoice("int8", f"auto: {no_int4}; int8 per-token linears run ({int8()})")
    except Exception as exc:  # noqa: BLE001
        return DtypeChoice("float32", f"auto: {no_int4}; int8 unavailable: {_why(exc)}")
