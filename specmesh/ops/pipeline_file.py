"""The declarative pipeline file (`specmesh run FILE`): lexer, parser and printer.
Mapping: specmesh/ops/pipeline_map.py.

    # comments start with '#' or '//'
    model draft "qwen2.5-coder-0.5b" { device: cpu  max_batch: 8 }
    model target "qwen2.5-coder-1.5b" { device: cpu  max_batch: 8 }
    pipeline speculative { draft: draft  target: target  max_new_tokens: 256  speculative_factor: 2 }
    run(prompt="def fibonacci(n):")

Values are strings ("..." with \\n, \\t, \\", \\\\ escapes), numbers, identifiers and true/false; block entries may
be separated by whitespace, ',' or ';'. Every error names its line and column (1-based).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Value = str | int | float | bool

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\n]+) | (?P<comment>(?:\#|//)[^\n]*) |
    (?P<string>"(?:[^"\\\n]|\\.)*") | (?P<badstring>"[^\n]*) |
    (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![A-Za-z_])) |
    (?P<ident>[A-Za-z_][A-Za-z0-9_.\-]*) | (?P<punct>[{}():=,;])
""", re.VERBOSE)
_IDENT = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "r": "\r"}


class PipelineError(ValueError):
    def __init__(self, message: str, line: int, col: int, source: str = "", filename: str = "<pipeline>") -> None:
        text = source.splitlines()[line - 1] if source and 0 < line <= len(source.splitlines()) else ""
        pointer = f"\n    {text}\n    {' ' * (col - 1)}^" if text else ""
        super().__init__(f"{filename}:{line}:{col}: {message}{pointer}")
        self.message, self.line, self.col = message, line, col


@dataclass(frozen=True)
class Token:
    kind: str           # string | number | ident | punct | eof
    text: str
    value: Value
    line: int
    col: int


@dataclass(frozen=True)
class Entry:
    key: str
    value: Value
    key_pos: tuple[int, int] = field(default=(0, 0), compare=False)
    value_pos: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Block:
    kind: str                  # "model" | "pipeline" | "run"
    label: str                 # model role (draft/target) or pipeline type (speculative); "" for run
    name: str                  # model reference; "" otherwise
    entries: tuple[Entry, ...]
    pos: tuple[int, int] = field(default=(0, 0), compare=False)
    label_pos: tuple[int, int] = field(default=(0, 0), compare=False)

    def get(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)


@dataclass(frozen=True)
class PipelineFile:
    blocks: tuple[Block, ...]
    source: str = field(default="", compare=False)
    filename: str = field(default="<pipeline>", compare=False)

    def error(self, message: str, pos: tuple[int, int]) -> PipelineError:
        return PipelineError(message, pos[0], pos[1], self.source, self.filename)


def _unescape(raw: str, line: int, col: int, source: str, filename: str) -> str:
    def sub(m: re.Match[str]) -> str:
        if m[1] not in _ESCAPES:
            raise PipelineError(f"unknown escape \\{m[1]} in string", line, col + m.start() + 1, source, filename)
        return _ESCAPES[m[1]]
    return re.sub(r"\\(.)", sub, raw[1:-1])


def tokenize(source: str, filename: str = "<pipeline>") -> list[Token]:
    tokens: list[Token] = []
    pos, line, line_start = 0, 1, 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        col = pos - line_start + 1
        if m is None or m.lastgroup == "badstring":
            what = "unterminated string" if m else f"unexpected character {source[pos]!r}"
            raise PipelineError(what, line, col, source, filename)
        kind, text = m.lastgroup or "", m.group()
        if kind == "string":
            tokens.append(Token(kind, text, _unescape(text, line, col, source, filename), line, col))
        elif kind == "number":
            tokens.append(Token(kind, text, float(text) if re.search(r"[.eE]", text) else int(text), line, col))
        elif kind in ("ident", "punct"):
            value: Value = {"true": True, "false": False}.get(text, text) if kind == "ident" else text
            tokens.append(Token(kind, text, value, line, col))
        newlines = text.count("\n")
        if newlines:
            line += newlines
            line_start = pos + text.rindex("\n") + 1
        pos = m.end()
    tokens.append(Token("eof", "end of file", "", line, pos - line_start + 1))
    return tokens


class _Parser:
    def __init__(self, source: str, filename: str) -> None:
        self.source, self.filename = source, filename
        self.tokens = tokenize(source, filename)
        self.i = 0

    def peek(self) -> Token:
        return self.tokens[self.i]

    def fail(self, message: str, tok: Token) -> PipelineError:
        return PipelineError(message, tok.line, tok.col, self.source, self.filename)

    def take(self, kind: str, text: str | None = None, what: str = "") -> Token:
        tok = self.peek()
        if tok.kind != kind or (text is not None and tok.text != text):
            raise self.fail(f"expected {what or repr(text) or kind}, found {tok.text!r}", tok)
        self.i += 1
        return tok

    def value(self) -> Token:
        tok = self.peek()
        if tok.kind not in ("string", "number", "ident"):
            raise self.fail(f"expected a value (string, number or name), found {tok.text!r}", tok)
        self.i += 1
        return tok

    def entries(self, close: str, sep: str) -> tuple[Entry, ...]:
        out: list[Entry] = []
        while self.peek().text != close or self.peek().kind != "punct":
            key = self.take("ident", what=f"a setting name or {close!r}")
            if any(e.key == key.text for e in out):
                raise self.fail(f"{key.text!r} is set twice", key)
            self.take("punct", sep)
            val = self.value()
            out.append(Entry(key.text, val.value, (key.line, key.col), (val.line, val.col)))
            if self.peek().kind == "punct" and self.peek().text in ",;":
                self.i += 1
            elif close == ")" and self.peek().text != ")":
                raise self.fail(f"expected ',' or ')', found {self.peek().text!r}", self.peek())
        self.take("punct", close)
        return tuple(out)

    def statement(self) -> Block:
        head = self.take("ident", what="'model', 'pipeline' or 'run'")
        pos = (head.line, head.col)
        if head.text == "model":
            label = self.take("ident", what="a model role (draft or target)")
            name = self.take("string", what='the model name in quotes, e.g. "qwen2.5-coder-1.5b"')
            self.take("punct", "{")
            return Block("model", label.text, str(name.value), self.entries("}", ":"), pos, (label.line, label.col))
        if head.text == "pipeline":
            label = self.take("ident", what="a pipeline type (speculative)")
            self.take("punct", "{")
            return Block("pipeline", label.text, "", self.entries("}", ":"), pos, (label.line, label.col))
        if head.text == "run":
            self.take("punct", "(")
            return Block("run", "", "", self.entries(")", "="), pos)
        raise self.fail(f"expected 'model', 'pipeline' or 'run', found {head.text!r}", head)

    def parse(self) -> PipelineFile:
        blocks = []
        while self.peek().kind != "eof":
            blocks.append(self.statement())
        return PipelineFile(tuple(blocks), self.source, self.filename)


def parse(source: str, filename: str = "<pipeline>") -> PipelineFile:
    """Syntax only; the meaning (known settings, references, types) is checked by pipeline_map.resolve()."""
    return _Parser(source, filename).parse()


def _quote(text: str) -> str:
    inverse = {v: k for k, v in _ESCAPES.items()}
    return '"' + "".join("\\" + inverse[c] if c in inverse else c for c in text) + '"'


def _fmt(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (value in ("true", "false") or not re.fullmatch(_IDENT, value)):
        return _quote(value)
    return str(value)


def format_file(pf: PipelineFile) -> str:
    """Canonical text of a parsed file (parse(format_file(pf)) == pf up to positions)."""
    lines = []
    for b in pf.blocks:
        body = "  ".join(f"{e.key}: {_fmt(e.value)}" for e in b.entries)
        if b.kind == "model":
            lines.append(f"model {b.label} {_quote(b.name)} {{ {body} }}")
        elif b.kind == "pipeline":
            lines.append(f"pipeline {b.label} {{ {body} }}")
        else:
            lines.append("run(" + ", ".join(f"{e.key}={_fmt(e.value)}" for e in b.entries) + ")")
    return "\n".join(lines) + "\n"
