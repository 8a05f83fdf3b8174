"""Investigation (a report, not product): which verifier numerics make a k-token forward cost close to a
1-token forward while staying batch invariant (a token's logits do not depend on how many tokens share the
forward), which is what exact greedy speculation needs.

Schemes (every nn.Linear of the model, lm_head included, is swapped):
  fp32         torch default (MKL sgemm / sgemv)
  bf16         bf16 weights and activations, fp32 accumulate inside oneDNN (AVX2 has no native bf16)
  int8-dyn     torch.ao quantize_dynamic: per-tensor activation scale computed over ALL tokens of the forward
  int8-pt      per-token activation scale on the stock fbgemm kernel: rows are normalized to absmax 1 and two
               columns (+1, -1) with zero weights are appended, so the kernel's dynamic per-tensor range is
               always exactly [-1, 1]; the int32 accumulation is exact, dequantization is elementwise, and the
               row is scaled back by its absmax -> batch invariant by construction
  int8-qdq     same per-token idea via quantized::linear_with_input_q_dq_qweight_dq_output_fp32 with a fixed
               input scale (rows pre-scaled to [-63, 63], zero point 64: 7-bit, no vpmaddubsw saturation)
  int8-intmm   per-token int8 activations x per-channel int8 weights through torch._int_mm (int32 out)
  int8-w8pack  weight-only int8: aten._weight_int8pack_mm (float activations)

Output: a cost table (ms per forward with a 64-token KV cache, k new tokens), an invariance table (max |logit
difference| between a token computed alone and inside a k-token forward, argmax flips), JSON in bench/results/.

    .venv/bin/python bench/verify_numerics.py                 # the real 1.5B target (needs `specmesh models fetch`)
    .venv/bin/python bench/verify_numerics.py --synthetic     # only the Linear-level tables, random weights
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import DEFAULT_WORKLOAD, median_s

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KS = (1, 2, 4, 8, 16)
CONTEXT = 64
ROWWISE = "rowwise"


# ------------------------------------------------------------------------------------------------- schemes
def _absmax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-1, keepdim=True).clamp_min(1e-30)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.quantized.linear_prepack(torch.quantize_per_channel(
        weight, _wscale(weight), torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8), bias)


def _wscale(weight: torch.Tensor) -> torch.Tensor:
    return (weight.abs().amax(1) / 127).clamp_min(1e-12).double()


class QuantLinear(nn.Module):
    """A drop-in for nn.Linear computing with one of the int8 / bf16 schemes above."""

    def __init__(self, linear: nn.Linear, scheme: str) -> None:
        super().__init__()
        self.scheme, self.out_features = scheme, linear.out_features
        w, b = linear.weight.detach().float(), None if linear.bias is None else linear.bias.detach().float()
        self.bias = b
        if scheme == "bf16":
            self.w = w.bfloat16()
        elif scheme == "int8-dyn":   # exactly what torch.ao.quantization.quantize_dynamic builds
            linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
            self.dyn = torch.ao.nn.quantized.dynamic.Linear.from_float(linear)
        elif scheme == "int8-pt":
            self.packed = _pack(torch.cat([w, torch.zeros(w.shape[0], 2)], 1), None)
        elif scheme == "int8-qdq":
            self.packed = _pack(w, None)
        elif scheme in ("int8-intmm", "int8-w8pack"):
            scale = _wscale(w).float()
            wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.wscale, self.wq = scale, (wq.t().contiguous() if scheme == "int8-intmm" else wq.contiguous())
        else:
            raise ValueError(scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]).float().contiguous())
        if self.bias is not None and self.scheme != "int8-dyn":
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if s == "bf16":
            return F.linear(x.bfloat16(), self.w).float()
        if s == "int8-dyn":
            return self.dyn(x)
        a = _absmax(x)
        if s == "int8-pt":
            ones = torch.ones(x.shape[0], 1)
            return torch.ops.quantized.linear_dynamic(torch.cat([x / a, ones, -ones], 1), self.packed, True) * a
        if s == "int8-qdq":
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x * (63 / a), 1.0, 64, self.packed)
            return y * (a / 63)
        if s == "int8-intmm":
            xq = torch.round(x * (127 / a)).to(torch.int8)
            return torch._int_mm(xq, self.wq).float() * (a / 127) * self.wscale
        return torch.ops.aten._weight_int8pack_mm(x, self.wq, self.wscale)


def swap_linears(model: nn.Module, scheme: str) -> Callable[[], None]:
    """Replace every nn.Linear under model (fp32 = keep); returns a function restoring the originals."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    if scheme != "fp32":
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    swapped.append((parent, name, child))
                    setattr(parent, name, QuantLinear(child, scheme))

    def restore() -> None:
        for parent, name, child in swapped:
            setattr(parent, name, child)
    return restore


# ------------------------------------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], object], reps: int) -> float:
    return round(median_s(fn, reps) * 1000, 2)


def invariance(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ks: tuple[int, ...]) -> dict[int, tuple]:
    """Rows computed in blocks of k vs one at a time: {k: (max |difference|, argmax flips)}."""
    singles = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
    out = {}
    for k in ks:
        blocks = torch.cat([fn(x[i:i + k]) for i in range(0, len(x), k)])
        out[k] = (float((blocks - singles).abs().max()), int((blocks.argmax(-1) != singles.argmax(-1)).sum()))
    return out


# ------------------------------------------------------------------------------------------------- Linear level
LINEAR_SCHEMES = ("fp32", "bf16", "int8-dyn", "int8-pt", "int8-qdq", "int8-intmm", "int8-w8pack")
SLOW_SCHEMES = ("int8-intmm", "int8-w8pack")   # far slower: fewer inputs and reps


def make_linear(linear: nn.Linear, scheme: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return linear if scheme == "fp32" else QuantLinear(linear, scheme)


def linear_table(linear: nn.Linear, inputs: torch.Tensor, copies: int, reps: int,
                 schemes: tuple[str, ...] = LINEAR_SCHEMES) -> dict[str, dict]:
    """Per scheme: ms per call for k rows (cycling through `copies` weight copies so weights come from DRAM
    as in a real forward, not from cache) and batch invariance over `inputs` at each k."""
    fp32_copies = [linear]
    for _ in range(copies - 1):
        c = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).requires_grad_(False)
        c.load_state_dict(linear.state_dict())
        fp32_copies.append(c)
    table = {}
    for scheme in schemes:
        table[scheme] = scheme_entry([make_linear(c, scheme) for c in fp32_copies], scheme, inputs, reps)
        table[scheme]["rel_err_vs_fp32"] = rel_err(make_linear(linear, scheme)(inputs[:64]), linear(inputs[:64]))
        print(f"  {scheme:12s} ms {table[scheme]['ms']}  max|diff| {table[scheme]['max_abs_diff']}", flush=True)
    return table


@torch.inference_mode()
def scheme_entry(fns: list[Callable[[torch.Tensor], torch.Tensor]], scheme: str, inputs: torch.Tensor,
                 reps: int) -> dict:
    turn = iter(range(10**9))
    slow = scheme in SLOW_SCHEMES

    def call(k: int) -> torch.Tensor:
        return fns[next(turn) % len(fns)](inputs[:k])
    costs = {k: median_ms(lambda k=k: call(k), 1 if slow else reps) for k in KS}
    rows = inputs[:48] if slow else inputs
    inv = invariance(fns[0], rows, KS[1:])
    return {"ms": costs, "max_abs_diff": {k: v[0] for k, v in inv.items()},
            "argmax_flips": {k: v[1] for k, v in inv.items()}, "inputs": len(rows)}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------------------- model level
# (linear scheme, torch threads, attention implementation, run the invariance test)
MODEL_SCHEMES = (("fp32", 1, "sdpa", True), ("fp32", 2, "sdpa", False), ("int8-dyn", 1, "sdpa", True),
                 ("int8-pt", 1, "sdpa", True), ("int8-pt", 1, ROWWISE, True), ("int8-qdq", 1, ROWWISE, True),
                 ("int8-pt", 2, ROWWISE, True))


def rowwise_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """Causal attention one query at a time: query i of T new tokens attends keys [0, S - T + i] with a
    1-query SDPA call, exactly the call a 1-token decode step makes, so the result cannot depend on T."""
    num_new, num_keys = query.shape[2], key.shape[2]
    outs = [F.scaled_dot_product_attention(query[:, :, i:i + 1], key[:, :, :num_keys - num_new + i + 1],
                                           value[:, :, :num_keys - num_new + i + 1], scale=scaling,
                                           enable_gqa=query.shape[1] != key.shape[1]) for i in range(num_new)]
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


def set_attention(model: nn.Module, name: str) -> None:
    if name == ROWWISE:
        from transformers import AttentionInterface
        AttentionInterface.register(ROWWISE, rowwise_attention)
    model.config._attn_implementation = name


def workload_ids(tokenizer, path: Path, n_tokens: int) -> list[int]:
    ids: list[int] = []
    for line in path.read_text().splitlines():
        if line.strip():
            msgs = [{"role": "user", "content": json.loads(line)["prompt"]}]
            ids += tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    while len(ids) < n_tokens:
        ids += ids
    return ids


@torch.inference_mode()
def logits_after(model, ids: torch.Tensor, cache) -> torch.Tensor:
    return model(input_ids=ids[None], past_key_values=cache, use_cache=True).logits[0].float()


def crop_to(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def model_costs(model, ids: list[int], reps: int) -> dict[int, float]:
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    logits_after(model, torch.tensor(ids[:CONTEXT]), cache)
    costs = {}
    for k in KS:
        new = torch.tensor(ids[CONTEXT:CONTEXT + k])

        def step(new=new) -> None:
            logits_after(model, new, cache)
            crop_to(cache, CONTEXT)
        costs[k] = median_ms(step, reps)
    return costs


@torch.inference_mode()
def model_invariance(model, windows: list[list[int]], k: int) -> tuple[float, int, list[int]]:
    """One k-token forward vs k one-token forwards after the same context, per window. Returns max |logit
    diff|, argmax flips, and the one-at-a-time argmaxes."""
    from transformers import DynamicCache
    worst, flips, argmaxes = 0.0, 0, []
    for window in windows:
        cache = DynamicCache(config=model.config)
        logits_after(model, torch.tensor(window[:CONTEXT]), cache)
        block = logits_after(model, torch.tensor(window[CONTEXT:CONTEXT + k]), cache)
        crop_to(cache, CONTEXT)
        singles = torch.cat([logits_after(model, torch.tensor(window[CONTEXT + i:CONTEXT + i + 1]), cache)
                             for i in range(k)])
        worst = max(worst, float((block - singles).abs().max()))
        flips += int((block.argmax(-1) != singles.argmax(-1)).sum())
        argmaxes += singles.argmax(-1).tolist()
    return worst, flips, argmaxes


def model_table(model, ids: list[int], windows: int, reps: int) -> dict[str, dict]:
    starts = [i * (CONTEXT + 16) for i in range(windows)]
    wins = [ids[s:s + CONTEXT + 16] for s in starts]
    table: dict[str, dict] = {}
    reference: list[int] = []
    for scheme, threads, attn, check in MODEL_SCHEMES:
        torch.set_num_threads(threads)
        set_attention(model, attn)
        restore = swap_linears(model, scheme)
        entry: dict = {"threads": threads, "attention": attn, "ms": model_costs(model, ids, reps)}
        if check:
            diff, flips, argmaxes = model_invariance(model, wins, 16)
            reference = reference or argmaxes
            agree = sum(a == b for a, b in zip(argmaxes, reference, strict=True)) / len(reference)
            entry |= {"max_abs_diff_k16": diff, "argmax_flips_k16": flips, "positions": len(argmaxes),
                      "top1_agreement_vs_fp32": round(agree, 4)}
        restore()
        table[f"{scheme}@{threads}t/{attn}"] = entry
        print(f"  {scheme}@{threads}t/{attn} {entry}", flush=True)
    torch.set_num_threads(1)
    set_attention(model, "sdpa")
    return table


@torch.inference_mode()
def lm_head_inputs(model, ids: list[int], n: int) -> torch.Tensor:
    """Real final hidden states (fp32) plus perturbed copies: realistic inputs to the vocabulary projection."""
    hidden = model.model(input_ids=torch.tensor(ids[:n // 2])[None]).last_hidden_state[0].float()
    noise = torch.randn_like(hidden) * hidden.std() * 0.05
    return torch.cat([hidden, hidden + noise])


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Cost and batch invariance of verifier numerics (report script).")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="model reference for specmesh.models.load_model")
    p.add_argument("--synthetic", action="store_true", help="only Linear-level tables with random weights")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help="JSONL whose prompts give the model-level text")
    p.add_argument("--windows", type=int, default=2, help="16-token windows for the model-level invariance test")
    p.add_argument("--rows", type=int, default=320, help="inputs for the Linear-level invariance test")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", default="linear,model", help="comma list: linear (Linear-level tables), model")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def synthetic_gate(rows: int) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    gate = nn.Linear(1536, 8960, bias=False).requires_grad_(False)
    gate.weight.normal_(0, 0.02)
    x = torch.randn(rows, 1536)
    x[:, :8] *= 20   # a few outlier channels, as in real LLM activations
    return gate, x


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report: dict = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "context_tokens": CONTEXT, "ks": list(KS)}
    if args.synthetic:
        gate, x = synthetic_gate(args.rows)
        print("Linear 1536->8960 (synthetic weights)", flush=True)
        report["linear_gate_synthetic"] = linear_table(gate, x, copies=3, reps=args.reps)
        return report
    from specmesh.models import load_model
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    report["model"], report["load_s"] = args.model, round(time.perf_counter() - t0, 1)
    ids = workload_ids(tok, Path(args.workload), args.windows * (CONTEXT + 16) + KS[-1] + CONTEXT)
    if "linear" in args.parts:
        report |= real_linear_tables(model, ids, args)
    if "model" in args.parts:
        print("Whole model", flush=True)
        report["model_level"] = model_table(model, ids, args.windows, args.reps)
    return report


def real_linear_tables(model, ids: list[int], args: argparse.Namespace) -> dict:
    gate = model.model.layers[0].mlp.gate_proj
    with torch.inference_mode():
        mlp_in = model.model.layers[0].post_attention_layernorm(
            model.model.embed_tokens(torch.tensor(ids[:args.rows])))
    print("Linear gate_proj 1536->8960 (layer 0 weights, embedding-derived inputs)", flush=True)
    out = {"linear_gate": linear_table(gate, mlp_in.float(), copies=3, reps=args.reps)}
    print("Linear lm_head 1536->151936 (real weights, real final hidden states)", flush=True)
    head_in = lm_head_inputs(model, ids, min(args.rows, 160))
    out["linear_lm_head"] = linear_table(model.lm_head, head_in, copies=1, reps=args.reps,
                                         schemes=("fp32", "int8-dyn", "int8-pt", "int8-qdq"))
    return out


def print_tables(report: dict) -> None:
    for key in ("linear_gate_synthetic", "linear_gate", "linear_lm_head"):
        if key in report:
            print(f"\n{key}: ms per call for k rows | max|diff| block vs single (k=16) | argmax flips | rel err")
            for scheme, e in report[key].items():
                ms = " ".join(f"{e['ms'][k]:8.2f}" for k in KS)
                print(f"  {scheme:12s} {ms} | {e['max_abs_diff'][16]:.3g} | {sum(e['argmax_flips'].values())}"
                      f"/{e['inputs']} | {e['rel_err_vs_fp32']:.3g}")
    if "model_level" in report:
        print("\nmodel: ms per forward, k = " + " ".join(f"{k:>8d}" for k in KS) + " | k16/k1 | max|diff| | flips | "
              "top-1 agreement vs fp32")
        for name, e in report["model_level"].items():
            ms = " ".join(f"{e['ms'][k]:8.1f}" for k in KS)
            extra = (f"{e['max_abs_diff_k16']:.3g} | {e['argmax_flips_k16']}/{e['positions']} | "
                     f"{e['top1_agreement_vs_fp32']}") if "positions" in e else "-"
            print(f"  {name:22s} {ms} | {e['ms'][16] / e['ms'][1]:.2f} | {extra}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print_tables(report)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS_DIR / f"verify-numerics-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
