"""The meaning of every configuration field, for `--help`: the trailing comment of the field in specmesh/config.py
(one source of truth: a new field documents its flag by its comment), or, for the few fields without one, the
FALLBACK text below.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize
from typing import Any, get_type_hints

FALLBACK: dict[str, str] = {
    "host": "address to listen on (0.0.0.0 = every interface)",
    "port": "gRPC port to listen on",
    "tls_client_key": "private key of tls_client_cert",
    "max_draft_tokens": "largest draft length one Propose may ask for (more: INVALID_ARGUMENT)",
    "default_max_new_tokens": "max_new_tokens of a request that gives none",
    "max_new_tokens_limit": "largest max_new_tokens a request may ask for (more: INVALID_ARGUMENT)",
    "max_prompt_chars": "longest prompt accepted, in characters (longer: INVALID_ARGUMENT)",
    "max_stop_strings": "most stop strings one request may give",
    "max_stop_string_len": "longest stop string accepted, in characters",
    "verifier_timeout_s": "deadline of one call to the verifier, in seconds",
    "cache_dir": "model cache for the tokenizer; \"\" = $SPECMESH_CACHE_DIR or ~/.cache/specmesh",
    "cache_ttl_s": "seconds a draft-cache entry lives",
    "ngram_sizes": "n-gram lengths the prompt-lookup drafter matches, longest first",
}


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment in the class body: the comment on the field's line, joined with the comment-only
    lines right below it (a comment continued under the first). {} where the source is not installed."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    current = ""            # the field whose line (or continuation) we are on
    line_start = True       # the next token begins a logical line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if current and text:
                out[current] = f"{out[current]} {text}".strip() if current in out else text
            continue
        if tok.type in (tokenize.NL, tokenize.NEWLINE):
            line_start = True
            continue
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        if line_start:
            current = tok.string if tok.type == tokenize.NAME and tok.string in _field_names(cls) else ""
            line_start = False
    return out


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def field_help(cls: type, dotted: str) -> str:
    """The meaning of a flattened field ("port", "engine.dtype") of a service config class."""
    owner, leaf = cls, dotted
    while "." in leaf:
        head, leaf = leaf.split(".", 1)
        owner = get_type_hints(owner)[head]
    return field_comments(owner).get(leaf) or FALLBACK.get(leaf, "")


def flag_help(cls: type, dotted: str, env_name: str, default: Any) -> str:
    """`--flag` help: meaning, the environment variable and the default (percent signs escaped for argparse)."""
    shown = f'"{default}"' if isinstance(default, str) else int(default) if isinstance(default, bool) else default
    meaning = field_help(cls, dotted) or "(undocumented)"
    return f"{meaning} (env {env_name}; default {shown})".replace("%", "%%")
