"""Reading, writing and overriding run configs: YAML <-> the typed dataclasses of ``config.schema``.

The path of a config through this module::

    YAML file --yaml_text.parse_yaml (bounded safe_load: duplicate keys, control characters, alias bombs and
                integers of > 100 digits refused)--> raw dict
      --mindformers.adapt--> native dict (+ notes: keys mapped, reinterpreted, ignored)
      --apply_overrides(["train.lr=1e-3", ...])--> native dict
      --mindformers.finish--> native dict (a MindFormers run length / warmup that depends on the overrides)
      --config_from_dict (strict: unknown keys, wrong types, numbers outside config.ranges, NaN/inf)--> Config

``config_from_dict`` walks the dataclass fields with their type hints and coerces each value; the coercion is
deliberately small: ``int``, ``float``, ``bool``, ``str``, ``X | None``, nested dataclasses, ``list[Dataclass]``
and ``Any`` (kept as written). YAML 1.1 reads ``1e-4`` (no dot) as a string, so numeric strings are accepted
for number fields. Every mistake raises :class:`ConfigError` naming the file and the dotted key; an unknown
key comes with the closest valid name (difflib). Cross-field rules are not here but in ``resolve.validate``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from llmtrain.config import mindformers
from llmtrain.config.ranges import nonfinite_path, range_problem, show
from llmtrain.config.schema import Config, DatasetSpec
from llmtrain.config.yaml_text import MAX_CONFIG_DEPTH, parse_yaml, refuse_control
from llmtrain.errors import ConfigError


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """Read a YAML config (native or MindFormers layout), apply dotted overrides; return (config, notes).

    A wrong value that came from an override is blamed on the override, not on the file."""
    path = Path(path)
    raw = read_yaml(path)
    if not raw and not overrides:
        raise ConfigError(
            f"config file {path} is empty: it needs at least a model: section (see configs/demo.yaml)."
        )
    native, notes = mindformers.adapt(raw, source=str(path))
    native = apply_overrides(native, overrides)
    notes += mindformers.finish(native, source=str(path))  # MindFormers figures that depend on overrides
    given = {item.partition("=")[0].strip(): item for item in overrides}
    return config_from_dict(native, source=_Source(str(path), given)), notes


class _Source(str):
    """A config's file name that also knows which dotted keys the command line set (``key -> "key=value"``)."""

    overrides: dict[str, str]

    def __new__(cls, name: str, overrides: dict[str, str]) -> _Source:
        obj = super().__new__(cls, name)
        obj.overrides = overrides
        return obj

    def blame(self, key: str) -> str:
        """Who wrote the value at dotted ``key``: the override that set it (or a section above it), or the file."""
        item = self.overrides.get(key)
        return f"command-line override {show(item)} (over {str(self)})" if item else str(self)


def read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML file, read with a safe loader that rejects duplicate keys, bounded in size,
    depth and alias expansion, and refusing control characters and numbers of absurd length."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read as UTF-8 text: {e}.") from None
    data = parse_yaml(text, f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: the top level must be a mapping of sections (model:, parallel:, train:, "
            f"data:, ...), got a {type(data).__name__}."
        )
    return data


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict of a Config (the YAML layout)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path, header: str = "") -> None:
    """Write cfg as YAML after ``header`` (comment lines) atomically: a temporary file renamed into place, removed
    if the write fails; load_config reads it back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def apply_overrides(d: dict, overrides: Sequence[str]) -> dict:
    """A copy of the native dict d with each ``section.key=value`` set; the value is parsed by yaml.safe_load.

    Keys are our native names (checked against the schema, so a typo fails here with a suggestion). Values may
    be any YAML: ``train.lr=1e-3``, ``data.datasets=[{path: x, weight: 1}]``, ``train.decay_steps=null``.
    """
    out = copy.deepcopy(d)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        what = f"command-line override {show(item)}"
        if not sep or not key:
            raise ConfigError(f"{what} is not of the form section.key=value (e.g. train.lr=1e-3).")
        refuse_control(key, f"{what}: the key")
        parts = key.split(".")
        if len(parts) > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"{what}: the key has {len(parts):,} dotted parts; a config key has at most {MAX_CONFIG_DEPTH} "
                f"(section.key, or a few levels inside a mapping such as model.rope_scaling.factor)."
            )
        _check_override_key(parts, item)
        value = parse_yaml(text, f"{what}: the value")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{what}: {'.'.join(parts[: i + 1])} is not a mapping in the config (it is {show(child)}), "
                    f"so it has no key {parts[i + 1]!r}."
                )
            node = child
        node[parts[-1]] = value
    return out


def _check_override_key(parts: list[str], item: str) -> None:
    """Raise ConfigError unless parts names a field of Config (or a key inside an ``Any`` mapping field)."""
    cls: Any = Config
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            if cls is Any:  # free-form value such as model.rope_scaling: any sub-key is allowed
                return
            raise ConfigError(
                f"command-line override {show(item)}: {'.'.join(parts[:i])} is a single value, not a section."
            )
        hints = typing.get_type_hints(cls)
        if part not in hints:
            prefix = ".".join(parts[:i])
            raise ConfigError(
                f"command-line override {show(item)}: unknown key {show('.'.join(parts[: i + 1]))}"
                f"{_suggest(part, list(hints), prefix)}. Valid keys"
                f"{' in ' + prefix if prefix else ' (sections)'}: {', '.join(hints)}."
            )
        cls = _strip_optional(hints[part])


def config_from_dict(d: dict, source: str = "<dict>") -> Config:
    """Build a Config from a native nested dict. Strict: unknown keys and wrong types raise ConfigError."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(d).__name__}.")
    return _build(Config, d, prefix="", source=source)


def check_section(cls: type, section: dict, prefix: str, source: str) -> dict:
    """``section`` (a mapping read from a config, e.g. ``data.prepare``) checked against the dataclass ``cls``
    as a config section is: unknown keys, types, number ranges (``config.ranges``, keys ``prefix + name``), no
    NaN/inf; returns the keys it holds with their coerced values (a nested section as a dict)."""
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.')}: expected a mapping of keys, got {show(section)}.")
    built = _build(cls, section, prefix=prefix, source=source)
    return {
        str(k): dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        for k in section
        for v in [getattr(built, str(k))]
    }


def _build(cls: type, d: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for raw_key, value in d.items():
        key = str(raw_key)
        if key not in hints:
            raise ConfigError(_unknown_key_message(cls, key, prefix, list(hints), source))
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}", source)
    return cls(**kwargs)


def _unknown_key_message(cls: type, key: str, prefix: str, valid: list[str], source: str) -> str:
    section = prefix.rstrip(".")
    hint = _suggest(key, valid, section)
    if section:
        return f"{source}: unknown key {prefix + key!r}{hint}. Valid keys in {section!r}: {', '.join(valid)}."
    if not hint:  # a field written at the top level instead of inside its section?
        sections = typing.get_type_hints(Config)
        owners = [
            f"{name}.{key}"
            for name, sec in sections.items()
            if dataclasses.is_dataclass(sec) and key in typing.get_type_hints(sec)
        ]
        if owners:
            hint = f" (did you mean {owners[0]!r}? fields live inside their section)"
    return f"{source}: unknown top-level section {key!r}{hint}. Valid sections: {', '.join(valid)}."


def _suggest(key: str, valid: list[str], section: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {(section + '.' if section else '') + close[0]!r}?)"


def _strip_optional(tp: Any) -> Any:
    """T for ``T | None``; tp otherwise."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """value converted to the field type tp, or ConfigError naming source and key. Numbers are checked against
    their range (``config.ranges``) here, before anything can allocate or loop on them; free-form values
    (``Any``, ``dict``) may hold no NaN or infinity."""
    if isinstance(source, _Source) and key in source.overrides:
        source = source.blame(key)  # the whole value below this key came from the command line
    optional = _is_union(tp) and type(None) in typing.get_args(tp)
    inner = _strip_optional(tp)
    if inner is Any or inner is dict or typing.get_origin(inner) is dict:
        bad = nonfinite_path(value, key)
        if bad is not None:
            raise ConfigError(
                f"{source}: {bad[0]}: {show(bad[1])} is not a finite number; NaN and infinity mean nothing in a "
                f"config (write the number itself)."
            )
    if tp is Any:
        return value
    if _is_union(tp):
        if value is None and optional:
            return None
        tp = _strip_optional(tp)
    if typing.get_origin(tp) is typing.Literal:
        return _choice(value, typing.get_args(tp), key, source)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp is DatasetSpec and isinstance(value, str):  # shorthand: a bare prefix means weight 1
            value = {"path": value}
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping of keys, got {show(value)}.")
        return _build(tp, value, prefix=f"{key}.", source=source)
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}: expected a list, got {show(value)}.")
        return [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is dict or typing.get_origin(tp) is dict:  # free-form mappings (validated by their consumer)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {show(value)}.")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key}: expected true or false, got {show(value)}.")
    if tp is int or tp is float:
        number = _number(value, finite=False)
        if isinstance(number, float) and not math.isfinite(number):  # NaN / inf / 1e999: say what is valid
            problem = range_problem(key, number, tp is int, optional, written=value)
            spelled = isinstance(value, float) or any(w in str(value).lower() for w in ("nan", "inf"))
            raise ConfigError(
                f"{source}: {problem}" + (" NaN and infinity mean nothing in a config." if spelled else "")
            )
        if number is None or (tp is int and number != int(number)):
            kind = "an integer" if tp is int else "a number"
            raise ConfigError(f"{source}: {key}: expected {kind}, got {show(value)}.")
        try:
            number = int(number) if tp is int else float(number)
        except OverflowError:  # an integer past float's range written for a float field
            number = math.inf
        problem = range_problem(key, number, tp is int, optional, written=value)
        if problem:
            raise ConfigError(f"{source}: {problem}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: {key}: expected a string, got {show(value)}.")
    raise ConfigError(f"{source}: {key}: field type {tp!r} is not supported by the loader.")  # schema bug


def choice_error(key: str, value: Any, allowed: Sequence[Any], hint: str = "") -> str:
    """The one message for a value outside a field's allowed values (a ``Literal`` in the schema)."""
    names = [str(a) for a in allowed if a is not None]
    close = difflib.get_close_matches(str(value).lower(), names, n=1, cutoff=0.5)
    near = f" (did you mean {close[0]!r}?)" if close else ""
    shown = ", ".join(names) + (" or null" if None in allowed else "")
    return f"{key}: {value!r} is not one of {shown}{near}{hint}."


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a field type ``Literal[...]`` / ``Literal[...] | None`` (None: not a Literal)."""
    optional = _is_union(tp) and type(None) in typing.get_args(tp)
    tp = _strip_optional(tp)
    if typing.get_origin(tp) is not typing.Literal:
        return None
    return (*typing.get_args(tp), *((None,) if optional else ()))


def _choice(value: Any, allowed: tuple[Any, ...], key: str, source: str) -> Any:
    if isinstance(value, str | int | float) and not isinstance(value, bool) and value in allowed:
        return value
    raise ConfigError(f"{source}: {choice_error(key, value, allowed)}")


def _number(value: Any, finite: bool = True) -> float | int | None:
    """value as int/float, accepting numeric strings (YAML 1.1 reads 1e-4 as a string); None if not numeric (or,
    with finite, NaN or infinite)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
    if number is None or (finite and not math.isfinite(number)):
        return None
    return number
