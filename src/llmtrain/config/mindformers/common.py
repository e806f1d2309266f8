"""The machinery every MindFormers mapping shares: spec entries, the walk over a section, notes and errors.

A section of a MindFormers file is mapped by a *spec*: a dict from each key MindFormers defines there to what
the key becomes. The entries are data where they can be:

* :class:`To` ``("train.lr")``: the same meaning under a native dotted name (optionally converted);
* :class:`Ignore` ``(reason)``: no PyTorch meaning; accepted and listed by name with the reason;
* :class:`Only` ``(allowed, reason, refusal)``: harmless at the allowed values (then ignored with the reason),
  refused otherwise because llmtrain cannot do what the value asks (the refusal says what to change);
* :class:`Fact` ``(name)``: kept in :attr:`Ctx.facts` for a computation that needs several keys (the global
  batch, the run length, the pipeline split...);
* a function ``(ctx, dotted_name, value)`` for anything else.

:func:`walk` applies a spec to a mapping; a key with no entry is a ConfigError naming it, with the closest
known key. :class:`To`, :class:`Fact` and :func:`collect` entries may name the type their value must have
(``expect``: :data:`EXPECT`); :func:`typed`, the one typed read, checks it as the key is read, so a value of the
wrong type (``num_layers: "32"``, ``32.0``, ``[32]``) is a ConfigError naming the key and the file before any
computation sees it. :class:`Notes` collects what ``llmtrain check`` prints: one summary of renames, one line per
reinterpreted key, and the ignored keys grouped by reason.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from llmtrain.errors import ConfigError


@dataclass(frozen=True)
class To:
    """Same meaning under the native dotted key ``target``; ``convert`` turns the MindFormers value into ours."""

    target: str
    convert: Callable[[Any], Any] | None = None
    expect: str | None = None


@dataclass(frozen=True)
class Ignore:
    """Accepted without effect; ``reason`` says why nothing in PyTorch corresponds."""

    reason: str


@dataclass(frozen=True)
class Only:
    """Accepted (and ignored with ``reason``) when the value is one of ``allowed``; else ``refusal``."""

    allowed: tuple[Any, ...]
    reason: str
    refusal: str


@dataclass(frozen=True)
class Fact:
    """Kept as ``ctx.facts[name]`` for a computation after the walk."""

    name: str
    expect: str | None = None


Handler = Callable[["Ctx", str, Any], None]
Entry = Union[To, Ignore, Only, Fact, Handler]
Spec = dict[str, Entry]


class Notes:
    """What the adapter tells the user, in three groups: renames, reinterpretations, ignored keys by reason."""

    def __init__(self) -> None:
        self.renames: list[str] = []
        self.lines: list[str] = []
        self.ignored: dict[str, list[str]] = {}

    def renamed(self, name: str, target: str) -> None:
        self.renames.append(f"{name} -> {target}")

    def add(self, line: str) -> None:
        self.lines.append(line)

    def ignore(self, name: str, reason: str) -> None:
        self.ignored.setdefault(reason, []).append(name)

    def render(self) -> list[str]:
        out = ["MindFormers keys mapped: " + ", ".join(self.renames) + "."] if self.renames else []
        out += self.lines
        out += [f"ignored ({reason}): {', '.join(names)}." for reason, names in self.ignored.items()]
        return out


@dataclass
class Ctx:
    """One translation: the file's name, the native dict being built, the notes and the collected facts."""

    source: str
    out: dict[str, Any] = field(default_factory=dict)
    notes: Notes = field(default_factory=Notes)
    facts: dict[str, Any] = field(default_factory=dict)

    def put(self, dotted: str, value: Any) -> None:
        put(self.out, dotted, value)

    def has(self, dotted: str) -> bool:
        node: Any = self.out
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def written(self, *keys: str) -> str:
        """The facts ``keys`` as the file wrote them: ``data_parallel 8, model_parallel 4`` (absent ones left out)."""
        return ", ".join(
            f"{self.facts[k + '@'].rsplit('.', 1)[-1]} {self.facts[k]!r}"
            for k in keys
            if k + "@" in self.facts
        )

    def error(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {name}: {message}")


def names(text: str) -> tuple[str, ...]:
    """``"a b c"`` -> ``("a", "b", "c")``: long key lists stay readable (and stable under the formatter)."""
    return tuple(text.split())


def ignore_all(reason: str, keys: str) -> Spec:
    """One :class:`Ignore` entry per whitespace-separated key of ``keys``."""
    return {k: Ignore(reason) for k in names(keys)}


def collect(kind: str, canonical: str, expect: str | None = None) -> Handler:
    """A handler keeping the value as ``ctx.facts[kind][canonical] = (name, value)``; two spellings of one key
    (``num_layers`` and ``num_hidden_layers``) must agree; ``expect``: the value's type (:func:`typed`)."""

    def handler(ctx: Ctx, name: str, value: Any) -> None:
        value = typed(ctx, name, value, expect)
        seen = ctx.facts.setdefault(kind, {})
        if canonical in seen and seen[canonical][1] != value:
            raise ctx.error(name, f"{value!r} contradicts {seen[canonical][0]} {seen[canonical][1]!r}.")
        seen[canonical] = (name, value)

    return handler


def pending(ctx: Ctx, name: str, value: Any) -> None:
    """A key only a model family llmtrain does not have reads (MLA, MTP...): checked once the family is known."""
    ctx.facts.setdefault("pending", []).append((name, value))


def put(out: dict, dotted: str, value: Any) -> None:
    """Set ``out[a][b][c] = value`` for ``dotted`` ``a.b.c``, creating the sections."""
    *sections, key = dotted.split(".")
    node = out
    for name in sections:
        node = node.setdefault(name, {})
    node[key] = value


def walk(ctx: Ctx, prefix: str, mapping: Any, spec: Spec) -> None:
    """Apply ``spec`` to every key of ``mapping`` (the section named ``prefix``, '' for the top level)."""
    if not isinstance(mapping, dict):
        raise ctx.error(prefix, f"expected a mapping of keys, got {mapping!r}.")
    for raw_key, value in mapping.items():
        key = str(raw_key)
        name = f"{prefix}.{key}" if prefix else key
        entry = spec.get(key)
        if entry is None:
            raise unknown_key(ctx.source, prefix, key, spec)
        apply(ctx, name, value, entry)


def apply(ctx: Ctx, name: str, value: Any, entry: Entry) -> None:
    """Apply one spec entry to the key ``name`` holding ``value``."""
    if isinstance(entry, To):
        expect = entry.expect or (expect_of(entry.target) if entry.convert is None else None)
        value = typed(ctx, name, value, expect)
        ctx.put(entry.target, entry.convert(value) if entry.convert else value)
        ctx.notes.renamed(name, entry.target)
    elif isinstance(entry, Ignore):
        ctx.notes.ignore(name, entry.reason)
    elif isinstance(entry, Only):
        if not any(same(value, a) for a in entry.allowed):
            shown = " or ".join(repr(a) for a in entry.allowed)
            raise ctx.error(name, f"{value!r} is not supported: {entry.refusal} (accepted: {shown}).")
        ctx.notes.ignore(name, entry.reason)
    elif isinstance(entry, Fact):
        ctx.facts[entry.name] = typed(ctx, name, value, entry.expect)
        ctx.facts[entry.name + "@"] = name  # where it was written, for messages
    else:
        entry(ctx, name, value)


# expect -> (what the value must be, the check); null always passes (the key is unset: MindFormers' default)
EXPECT: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", lambda v: _is_int(v)),
    "int0": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "int1": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "num": ("a number", lambda v: _is_num(v)),
    "num0": ("a number >= 0", lambda v: _is_num(v) and v >= 0),
    "num+": ("a number > 0", lambda v: _is_num(v) and v > 0),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
}


_YAML_EXPONENT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def expect_of(target: str) -> str | None:
    """The :data:`EXPECT` of the native dotted key ``target`` from its annotation in ``config.schema`` (int ->
    int, float -> num, bool -> bool; None for anything else), for entries that name no type themselves."""
    import dataclasses
    import typing

    from llmtrain.config.schema import Config

    node: Any = Config
    hint: Any = None
    for part in target.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        hint = typing.get_type_hints(node).get(part)
        if hint is None:
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        node = args[0] if len(args) == 1 and typing.get_origin(hint) is not None else hint
    return {int: "int", float: "num", bool: "bool"}.get(node)


def typed(ctx: Ctx, name: str, value: Any, expect: str | None) -> Any:
    """``value`` when it has the type ``expect`` names (:data:`EXPECT`; None: any) or is null, else a ConfigError
    naming the file, the MindFormers key, the value and its type. The one typed read of the adapter."""
    if expect is None or value is None:
        return value
    what, ok = EXPECT[expect]
    if ok(value):
        return value
    if expect.startswith("num") and isinstance(value, str) and _YAML_EXPONENT.fullmatch(value.strip()):
        number = float(
            value
        )  # 1e-5: a number YAML 1.1 reads as a string (no dot); MindFormers' files write 1.e-5
        if ok(number):
            return number
    hint = ""
    if isinstance(value, str):
        hint = " YAML reads a quoted value as a string: write the number without quotes."
    elif isinstance(value, float) and expect.startswith("int"):
        hint = " MindFormers uses it as a count: write it without a decimal point."
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise ctx.error(name, f"expected {what}, got {shown} (a {type(value).__name__}).{hint}")


def same(value: Any, allowed: Any) -> bool:
    """Equality that keeps True apart from 1 and False apart from 0 (YAML writes both)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value is allowed
    if isinstance(value, str) and isinstance(allowed, str):
        return value.lower() == allowed.lower()
    return bool(value == allowed)


def unknown_key(source: str, prefix: str, key: str, spec: Spec) -> ConfigError:
    """The error for a key no spec entry covers, with the closest known key and the known ones."""
    known = sorted(spec)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    dotted = f"{prefix}.{key}" if prefix else key
    hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
    where = f"in {prefix}" if prefix else "at the top level"
    return ConfigError(
        f"{source}: unknown MindFormers key {dotted!r}{hint}: it has no mapping onto llmtrain and is not known "
        f"to be safe to ignore. Known keys {where}: {', '.join(known)}."
    )


def lookup(table: dict[str, str], value: Any, name: str, source: str) -> str:
    """``table[value]`` with case, '_' and '-' ignored; ConfigError listing the supported values."""
    key = str(value).lower().replace("_", "").replace("-", "")
    if key not in table:
        raise ConfigError(
            f"{source}: {name}: {value!r} is not supported; supported: "
            f"{', '.join(sorted(table))} (case-insensitive)."
        )
    return table[key]


def int_value(ctx: Ctx, name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an integer >= minimum, or ConfigError naming the key (:func:`typed`)."""
    typed(ctx, name, value, "int")
    if value is None or value < minimum:
        raise ctx.error(name, f"expected an integer >= {minimum}, got {value!r}.")
    return value


def fact_int(ctx: Ctx, key: str, default: int, minimum: int = 1) -> int:
    """``ctx.facts[key]`` as an integer >= minimum (ConfigError naming its key), ``default`` when absent."""
    if key not in ctx.facts or ctx.facts[key] is None:
        return default
    return int_value(ctx, ctx.facts[key + "@"], ctx.facts[key], minimum)


DEVICE_TARGETS = {"ascend": "npu", "gpu": "cuda", "cpu": "cpu"}


def compile_from_mode(mode: Any) -> bool | None:
    """MindSpore's context mode -> train.compile: GRAPH_MODE (0) compiles, PYNATIVE_MODE (1) runs eagerly."""
    if isinstance(mode, bool):
        return None
    return {0: True, "graph_mode": True, 1: False, "pynative_mode": False}.get(
        mode.lower() if isinstance(mode, str) else mode
    )
