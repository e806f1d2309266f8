"""Config text -> Python values, bounded: the YAML layer under ``config.loader`` (files and override values).

``parse_yaml`` reads one document with PyYAML's safe loader, refusing what a config never is and what would hang
or crash what comes after: a text longer than MAX_CONFIG_CHARS; a control character (raw in the text, or
written as an escape inside a string: NUL reaches ``open()``, ESC the terminal); a key written twice in one
mapping; an alias graph that is recursive, nests deeper than MAX_CONFIG_DEPTH or expands (billion laughs) to
more than MAX_CONFIG_NODES values or MAX_EXPANDED_CHARS characters, measured on the node graph without
expanding it; an integer of more than MAX_DIGITS digits (Python's ``int()`` refuses 4300). Each refusal is a
ConfigError that starts with what was read (``config file PATH``, ``command-line override 'k=v': the value``)
and names the line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from llmtrain.config.ranges import show
from llmtrain.errors import ConfigError


def parse_yaml(text: str, what: str, tags: Mapping[str, Callable[[str], Any]] | None = None) -> Any:
    """The one YAML document of ``text`` (safe_load semantics, duplicate keys refused), or ConfigError starting
    with ``what`` (``config file PATH``, ``command-line override 'k=v'``) when the text is too long, holds a
    control character, nests or expands past the bounds below, or has an integer of more than MAX_DIGITS
    digits; strings with control characters written as escapes (``"\\x00"``) are refused too. ``tags`` adds
    scalar tags (``{"!function": f}``: the scalar's text becomes ``f(text)``; lm-eval task files); every
    other tag is still refused."""
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(
            f"{what} is {len(text):,} characters long; a config is at most {MAX_CONFIG_CHARS:,} "
            f"(is this the right file?)."
        )
    refuse_control(text, what)
    try:
        loader = _with_tags(tags)(text)  # a SafeLoader subclass: safe_load semantics
    except yaml.YAMLError as e:  # the reader refuses a character PyYAML cannot represent
        raise ConfigError(f"{what} is not valid YAML: {e}.") from None
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_size(node, what)
        data = None if node is None else loader.construct_document(node)
    except RecursionError:
        raise ConfigError(
            f"{what} is nested too deeply to be a config (at most {MAX_CONFIG_DEPTH} levels)."
        ) from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{what} is not valid YAML{where}: {problem}.") from None
    finally:
        loader.dispose()
    _refuse_control_values(data, what)
    return data


# Bounds on what a config file may expand to: a billion-laughs alias bomb is a few hundred bytes of text.
MAX_CONFIG_CHARS = 4 * 1024 * 1024
MAX_CONFIG_NODES = 200_000  # scalars + collections after every alias is expanded
MAX_CONFIG_DEPTH = 64
MAX_EXPANDED_CHARS = 4 * MAX_CONFIG_CHARS  # text of all scalars once aliases are expanded (a string bomb)
MAX_DIGITS = 100  # an integer longer than this is no config value (and Python refuses int() past 4300 digits)

# Characters no config holds: C0 controls but tab and line breaks, DEL, C1 controls, lone surrogates.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
_CONTROL_NAMES = {0: "NUL", 7: "BEL", 8: "backspace", 0x0B: "vertical tab", 0x0C: "form feed", 0x1B: "ESC",
                  0x7F: "DEL"}  # fmt: skip


def _char_name(ch: str) -> str:
    name = _CONTROL_NAMES.get(ord(ch))
    return f"U+{ord(ch):04X}" + (f" ({name})" if name else "")


def refuse_control(text: str, what: str) -> None:
    """ConfigError naming the line and column of the first control character in the raw text."""
    m = _CONTROL.search(text)
    if m is None:
        return
    line = text.count("\n", 0, m.start()) + 1
    column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    raise ConfigError(
        f"{what} contains the control character {_char_name(m.group())} at line {line}, column {column}; a "
        f"config is plain text (tabs and line breaks only): remove it, or check that this is the right file."
    )


def _refuse_control_values(data: Any, what: str) -> None:
    """ConfigError naming the first key or string value (written with escapes) that holds a control character."""
    stack: list[tuple[Any, str]] = [(data, "")]
    seen: set[int] = set()  # an alias repeats one object: look at it once
    while stack:
        value, where = stack.pop()
        if isinstance(value, str | dict | list):
            if id(value) in seen:
                continue
            seen.add(id(value))
        if isinstance(value, str):
            m = _CONTROL.search(value)
            if m:
                raise ConfigError(
                    f"{what}: {where or 'the value'} = {show(value)} contains the control character "
                    f"{_char_name(m.group())}; config strings are plain text (names and paths): remove it."
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                key = f"{where}.{k}" if where else str(k)
                m = _CONTROL.search(k) if isinstance(k, str) else None
                if m:
                    raise ConfigError(
                        f"{what}: the key {show(k)} contains the control character {_char_name(m.group())}; "
                        f"keys are plain names: remove it."
                    )
                stack.append((v, key))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))


def _check_size(root: yaml.Node, what: str) -> None:
    """ConfigError if the document, with its aliases expanded, is cyclic, deeper than MAX_CONFIG_DEPTH, larger
    than MAX_CONFIG_NODES or holds more than MAX_EXPANDED_CHARS characters of scalars (computed on the node
    graph, without expanding anything)."""
    size: dict[int, int] = {}
    chars: dict[int, int] = {}  # characters of the scalars below a node, aliases expanded
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 0, False)]
    open_ids: set[int] = set()
    while stack:
        node, depth, done = stack.pop()
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            open_ids.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            chars[id(node)] = sum(chars[id(c)] for c in children) if children else len(str(node.value))
            if size[id(node)] > MAX_CONFIG_NODES or chars[id(node)] > MAX_EXPANDED_CHARS:
                what_big = (
                    f"more than {MAX_CONFIG_NODES:,} values"
                    if size[id(node)] > MAX_CONFIG_NODES
                    else f"more than {MAX_EXPANDED_CHARS:,} characters of text"
                )
                raise ConfigError(
                    f"{what} expands to {what_big} once its YAML aliases (*name) are expanded (line "
                    f"{node.start_mark.line + 1}); a config this large is not a config (an alias bomb?)."
                )
            continue
        if id(node) in size:
            continue
        if id(node) in open_ids:
            raise ConfigError(
                f"{what}: the YAML alias at line {node.start_mark.line + 1} refers to a collection "
                f"that contains it; a config cannot be recursive."
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"{what} is nested more than {MAX_CONFIG_DEPTH} levels deep (line "
                f"{node.start_mark.line + 1}); a config is a few levels of sections."
            )
        open_ids.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in size)


class _StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (plain safe_load keeps the last silently) and
    an integer of more than MAX_DIGITS digits (Python's int() raises past 4300)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(c.isdigit() or c in "abcdefABCDEF" for c in str(node.value))
        if digits > MAX_DIGITS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {digits:,} digits; a config number has at most {MAX_DIGITS}",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in the same mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictSafeLoader.add_constructor("tag:yaml.org,2002:int", _StrictSafeLoader.construct_yaml_int)


def _with_tags(tags: Mapping[str, Callable[[str], Any]] | None) -> type[_StrictSafeLoader]:
    """_StrictSafeLoader, or a subclass of it that also reads the scalar ``tags``."""
    if not tags:
        return _StrictSafeLoader

    class Tagged(_StrictSafeLoader):
        pass

    for tag, make in tags.items():

        def construct(loader: yaml.SafeLoader, node: yaml.Node, make: Callable[[str], Any] = make) -> Any:
            if not isinstance(node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{node.tag} takes one name (module.function), not a collection",
                    node.start_mark,
                )
            return make(str(loader.construct_scalar(node)))

        Tagged.add_constructor(tag, construct)
    return Tagged
