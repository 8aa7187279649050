"""SQL text: quoting names and values, and reading the argument lists of function calls.

The reader is a small tokenizer, not a parser: it knows string literals (``'...'``,
``E'...'``, ``$$...$$``), quoted identifiers (``"..."``), comments and brackets, which is all
it takes to find the calls of a function in a statement and to say which arguments were
given by position and which by name (``name := value`` or ``name => value``). The error
messages of :mod:`dpsql.duckdb.sql_errors` and the macro signatures of
:class:`dpsql.duckdb.context.Context` are built on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""
      (?P<space>\s+)
    | (?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    | (?P<string>[eE]?'(?:[^']|'')*(?:'|\Z))
    | (?P<dollar>\$(?P<tag>[A-Za-z_]*)\$.*?(?:\$(?P=tag)\$|\Z))
    | (?P<quoted>"(?:[^"]|"")*(?:"|\Z))
    | (?P<name>[A-Za-z_][A-Za-z0-9_$]*)
    | (?P<assign>:=|=>)
    | (?P<open>[(\[{])
    | (?P<close>[)\]}])
    | (?P<comma>,)
    | (?P<dot>\.)
    | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    #: an identifier's name (unquoted, case kept); "" for other tokens
    name: str = ""
    #: where the token ends in the statement (its start is ``end - len(text)``)
    end: int = 0


def tokens(sql: str) -> list[Token]:
    """The tokens of ``sql``, without white space and comments."""
    out = []
    for match in _TOKEN.finditer(sql):
        kind = match.lastgroup or "other"
        if kind in ("space", "comment"):
            continue
        text = match.group()
        if kind == "dollar":
            kind = "string"
        name = text if kind == "name" else text[1:-1].replace('""', '"') if kind == "quoted" else ""
        out.append(Token("name" if kind == "quoted" else kind, text, name, match.end()))
    return out


@dataclass
class Argument:
    """One argument of a call: its name when given as ``name := value``, its text."""

    name: str | None
    text: str
    #: was the name written without quotes (``window := 3``, which SQL reads as a keyword)?
    bare: bool = False


@dataclass
class Call:
    """A call ``name(arguments)`` found in a statement."""

    name: str
    arguments: list[Argument] = field(default_factory=list)

    @property
    def positional(self) -> list[Argument]:
        return [a for a in self.arguments if a.name is None]

    @property
    def named(self) -> list[Argument]:
        return [a for a in self.arguments if a.name is not None]


def calls(sql: str, names) -> Iterator[Call]:
    """The calls in ``sql`` of the functions ``names`` (lower-case), in order, nested ones too."""
    toks = tokens(sql)
    wanted = set(names)
    for i, tok in enumerate(toks[:-1]):
        if tok.kind == "name" and tok.name.lower() in wanted and toks[i + 1].kind == "open" \
                and toks[i + 1].text == "(" and (i == 0 or toks[i - 1].kind != "name" or toks[i - 1].text.upper()
                                                  not in ("MACRO", "FUNCTION")):
            yield Call(tok.name.lower(), _arguments(toks, i + 2, sql))


def _arguments(toks: list[Token], start: int, sql: str) -> list[Argument]:
    """The arguments of the call whose ``(`` is just before ``toks[start]``."""
    arguments: list[Argument] = []
    depth, piece = 0, list[Token]()
    for tok in toks[start:]:
        if tok.kind == "open":
            depth += 1
        elif tok.kind == "close":
            if depth == 0:
                break
            depth -= 1
        elif tok.kind == "comma" and depth == 0:
            arguments.append(_argument(piece, sql))
            piece = []
            continue
        piece.append(tok)
    if piece:
        arguments.append(_argument(piece, sql))
    return arguments


def _argument(piece: list[Token], sql: str) -> Argument:
    text = sql[piece[0].end - len(piece[0].text):piece[-1].end]
    if len(piece) >= 2 and piece[0].kind == "name" and piece[1].kind == "assign":
        return Argument(piece[0].name, text, bare=not piece[0].text.startswith('"'))
    return Argument(None, text)


@dataclass(frozen=True)
class Signature:
    """A macro's parameters: positional ones (required, in order), then named ones (with defaults)."""

    name: str
    positional: tuple[str, ...]
    named: tuple[str, ...]

    @property
    def valid(self) -> list[str]:
        return [*self.positional, *self.named]


def signature(header: str) -> Signature:
    """The signature of ``CREATE MACRO`` text ``header`` (``name(a, b := 1, ...) AS ...``)."""
    toks = tokens(header)
    name = next(t.name for t in toks if t.kind == "name")
    open_at = next(i for i, t in enumerate(toks) if t.kind == "open")
    arguments = _arguments(toks, open_at + 1, header)
    positional = tuple(a.text.strip('"') for a in arguments if a.name is None)
    named = tuple(a.name for a in arguments if a.name is not None)
    return Signature(name.lower(), positional, named)
