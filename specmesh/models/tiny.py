"""Tiny random-weight Qwen2 models for tests and local development.

Everything is built in-process and deterministically (fixed seeds, fixed corpus):

* a byte-level BPE tokenizer (vocab 512) trained on a small built-in English + Persian + code corpus,
  with ChatML special tokens and a Qwen-like chat template;
* ``tiny-target``: Qwen2 (hidden 64, 2 layers, 4 heads, 2 kv heads), seed 1234;
* ``tiny-draft``: byte-identical weights to ``tiny-target`` (speculation acceptance 1.0);
* ``tiny-draft-unrelated``: 1 layer, seed 98765 (acceptance near 0).

Weights use a larger init scale than transformers' default so greedy logits have clear top-1 margins
(typically ~1-2 logits, so fp32 reordering noise never flips an argmax).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import filelock
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specmesh.models.catalog import (  # noqa: F401 (re-exported names)
    TINY_DRAFT,
    TINY_DRAFT_UNRELATED,
    TINY_MARKER_NAME,
    TINY_PRESETS,
    TINY_RECIPE_VERSION,
    TINY_TARGET,
    tiny_is_built,
    tiny_models_dir,
)

MARKER_NAME = TINY_MARKER_NAME
VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END)

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""transformers' Qwen2Tokenizer split regex."""


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a large target model verifies.",
    "The target accepts the longest prefix that matches its own greedy choice, then adds one token.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Please summarize the following text in three sentences.",
    "The gateway streams tokens back to the client as soon as they are verified.",
    "Microservices talk to each other over gRPC with protocol buffers.",
    "سلام دنیا! حال شما چطور است؟",
    "زبان فارسی با الفبای عربی نوشته می‌شود و از راست به چپ خوانده می‌شود.",
    "مدل زبانی کوچک توکن‌ها را پیشنهاد می‌کند و مدل بزرگ آن‌ها را بررسی می‌کند.",
    "امروز هوا آفتابی است و ما به پارک می‌رویم.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Cache:\n    def __init__(self) -> None:\n        self.blocks: dict[int, list[int]] = {}\n",
    "import torch\nx = torch.zeros(4, 8)\ny = x @ x.T\n",
    "function add(a, b) { return a + b; }\nconst xs = [1, 2, 3].map((x) => x * 2);\n",
    "SELECT id, name FROM users WHERE active = 1 ORDER BY name;",
    "if (err != nil) {\n\treturn nil, err\n}\n",
    "<|im_start|>user\nWrite a function that reverses a string.<|im_end|>\n",
    "<|im_start|>assistant\ndef reverse(s):\n    return s[::-1]\n<|im_end|>\n",
)


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int
    num_layers: int
    same_as: str | None = None  # preset whose weights are copied verbatim


TINY_SPECS: dict[str, TinyModelSpec] = {
    TINY_TARGET: TinyModelSpec(seed=1234, num_layers=2),
    TINY_DRAFT: TinyModelSpec(seed=1234, num_layers=2, same_as=TINY_TARGET),
    TINY_DRAFT_UNRELATED: TinyModelSpec(seed=98765, num_layers=1),
}

# Init scales (transformers' default initializer_range 0.02 gives near-uniform logits on a model this small).
EMBED_STD = 1.0
LINEAR_STD = 0.2
BIAS_STD = 0.05
LM_HEAD_STD = 0.5


def _corpus_lines(repeats: int = 4) -> list[str]:
    return [line for _ in range(repeats) for line in _CORPUS]


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer (deterministic, well under a second)."""
    tok = Tokenizer(models.BPE())
    # Same pipeline as transformers' Qwen2Tokenizer, which AutoTokenizer rebuilds from vocab + merges when it
    # loads the saved dir (model_type qwen2): the in-process and reloaded tokenizers must encode identically.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(tokenizer: PreTrainedTokenizerFast, num_layers: int) -> Qwen2Config:
    eos_id = cast(int, tokenizer.convert_tokens_to_ids(EOS_TOKEN))      # one token in, one id out
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=LINEAR_STD,
        use_sliding_window=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def _init_weights(model: Qwen2ForCausalLM, seed: int) -> None:
    """Explicit, order-stable init from a private generator (independent of transformers' init code)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):
                std = BIAS_STD
            elif "embed_tokens" in name:
                std = EMBED_STD
            elif name.startswith("lm_head"):
                std = LM_HEAD_STD
            else:
                std = LINEAR_STD
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec) -> Qwen2ForCausalLM:
    with torch.random.fork_rng(devices=[]):  # the constructor's own init must not disturb the caller's RNG
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(tiny_config(tokenizer, spec.num_layers))
    _init_weights(model, spec.seed)
    model.generation_config = tiny_generation_config(tokenizer)
    return model.eval()


def tiny_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (IM_END, EOS_TOKEN)]
    return GenerationConfig(bos_token_id=eos_ids[1], eos_token_id=eos_ids, pad_token_id=eos_ids[1], do_sample=False)


def _is_complete(model_dir: Path) -> bool:
    return tiny_is_built(model_dir)


def _save_atomically(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER_NAME).write_text(f"{TINY_RECIPE_VERSION}\n")
    if dest.exists():  # an incomplete or stale dir (we hold the lock, so nobody is reading a fresh one)
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def build_tiny_models(out_dir: Path, rebuild: bool = False) -> dict[str, Path]:
    """Build all tiny presets into ``out_dir/<preset>`` (skipping complete ones unless ``rebuild``).

    Safe against concurrent builders: a file lock serializes them and each model dir appears via an
    atomic rename with its marker already inside.
    """
    out_dir = Path(out_dir)
    paths = {preset: out_dir / preset for preset in TINY_PRESETS}
    if not rebuild and all(_is_complete(p) for p in paths.values()):
        return paths
    out_dir.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(out_dir / ".build.lock")):
        todo = [p for p in TINY_PRESETS if rebuild or not _is_complete(paths[p])]
        if not todo:
            return paths
        tokenizer = train_tokenizer()
        built: dict[str, Qwen2ForCausalLM] = {}
        for preset in TINY_PRESETS:
            spec = TINY_SPECS[preset]
            if spec.same_as is not None and spec.same_as in built:
                model = built[spec.same_as]
            else:
                model = build_tiny_model(tokenizer, spec)
            built[preset] = model
            if preset in todo:
                _save_atomically(model, tokenizer, paths[preset])
    return paths
