"""Frozen config trees from the command line, and to/from JSON dicts.

Generic over any tree of frozen dataclasses: `apply_overrides(config, ["a.b=1e-6", ...])`,
`config_to_dict(config)`, `config_from_dict(cls, d)`; `add_flags` / `flag_overrides`: command-line
flags that are shortcuts for overrides, their help the field's `metadata["help"]`. Command-line
text is parsed by the field's annotation (`typing.get_type_hints`, so postponed annotations are
fine): int "3"; float "1e-6" or "3"; bool true/false/1/0 (any case); str as typed ('"none"' in
JSON quotes for the word none); `X | None` none/null (any case); Literal[...] one of its values;
tuple[X, ...] JSON '[1, 2]' or '1,2' ('[]' or '' when empty); a nested dataclass through
dotted keys or `key={"field": value, ...}` (JSON, merged into the current section).

A dataclass held by a field annotated `Any` (or a union of dataclasses) is written with
`"__dataclass__": "module:QualName"`, which `config_from_dict` and `key={...}` use to rebuild
that class. Overrides are gathered first and applied in one pass from the leaves up with
`dataclasses.replace`, so each touched section's `__post_init__` runs once on its final values
(fields that must change together can); its errors are re-raised prefixed with its path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

__all__ = [
    "CLASS_KEY",
    "add_flags",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "flag_overrides",
    "parse_override",
]

CLASS_KEY = "__dataclass__"
_NONE_WORDS = ("none", "null")
_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}
C = TypeVar("C")
Entry = tuple[tuple[str, ...], Any, str]  # (remaining key parts, value, full dotted key)


class _Text(str):
    """A value as typed on the command line (still to be parsed), unlike a JSON value."""


class _Mismatch(Exception):
    """The value does not fit one annotation (internal; callers see a ValueError)."""


# ---- annotations -------------------------------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Settable field name -> resolved annotation, in declaration order."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(f"cannot resolve the annotations of {cls.__qualname__}: {e}") from e
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _members(hint: Any) -> tuple[Any, ...]:
    is_union = typing.get_origin(hint) in (Union, types.UnionType)
    return typing.get_args(hint) if is_union else (hint,)


def _is_dataclass_type(t: Any) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _is_section(x: Any) -> bool:
    """A dataclass instance (not a class)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(hint, "__name__", str(hint))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _unknown(key: str, path: str, cls: type) -> ValueError:
    where = f"under {path!r}" if path else "at the top level"
    return ValueError(f"unknown config key {key!r}; valid keys {where}: {', '.join(_hints(cls))}")


def _resolve_class(name: Any, key: str) -> type:
    try:
        module, qualname = name.split(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (AttributeError, ImportError, ValueError) as e:
        raise ValueError(f"config key {key!r}: cannot import {CLASS_KEY} {name!r} ({e})") from e
    if not _is_dataclass_type(obj):
        raise ValueError(f"config key {key!r}: {CLASS_KEY} {name!r} is not a dataclass")
    return obj


# ---- building sections -------------------------------------------------------------------------
def _replace_or_build(make, path: str, cls: type):
    try:
        return make()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path or cls.__name__}: {e}") from e


def _construct(cls: type, mapping: Mapping[str, Any], path: str) -> Any:
    """A fresh `cls` from a field -> value mapping (missing fields take their defaults)."""
    hints, kwargs = _hints(cls), {}
    for name, value in mapping.items():
        if name == CLASS_KEY:
            continue
        key = _join(path, name)
        if name not in hints:
            raise _unknown(key, path, cls)
        kwargs[name] = _convert(value, hints[name], None, key)
    return _replace_or_build(lambda: cls(**kwargs), path, cls)


def _apply_section(instance: Any, entries: Sequence[Entry], path: str) -> Any:
    """`instance` with every entry applied, in one `dataclasses.replace`."""
    cls, hints = type(instance), _hints(type(instance))
    grouped: dict[str, list[Entry]] = {}
    for parts, value, key in entries:
        if parts[0] not in hints:
            raise _unknown(key, path, cls)
        grouped.setdefault(parts[0], []).append((parts[1:], value, key))
    changes = {}
    for name, items in grouped.items():
        key, hint = _join(path, name), hints[name]
        value, pending = getattr(instance, name), []
        for rest, raw, full in items:  # later entries win; a whole value resets the section
            if rest:
                pending.append((rest, raw, full))
                continue
            if pending:
                value, pending = _descend(value, hint, pending, key), []
            value = _convert(raw, hint, value, key)
        if pending:
            value = _descend(value, hint, pending, key)
        changes[name] = value
    return _replace_or_build(lambda: dataclasses.replace(instance, **changes), path, cls)


def _descend(current: Any, hint: Any, entries: Sequence[Entry], path: str) -> Any:
    if _is_section(current):
        return _apply_section(current, entries, path)
    classes = [m for m in _members(hint) if _is_dataclass_type(m)]
    if current is None and len(classes) == 1:
        return _apply_section(_construct(classes[0], {}, path), entries, path)
    raise ValueError(
        f"config key {entries[0][2]!r}: {path!r} is a {_type_name(hint)} holding "
        f"{current!r}, not a config section"
    )


# ---- values ------------------------------------------------------------------------------------
def _as_object(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, _Text) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, Mapping) and not isinstance(value, _Text) else None


def _convert(value: Any, hint: Any, current: Any, key: str) -> Any:
    """`value` (command-line text or a JSON value) as a value of annotation `hint`."""
    members = _members(hint)
    if type(None) in members and (
        value is None or (isinstance(value, _Text) and value.strip().lower() in _NONE_WORDS)
    ):
        return None
    classes = [m for m in members if _is_dataclass_type(m)]
    obj = _as_object(value) if classes or Any in members else None
    if obj is not None and (classes or _is_section(current) or CLASS_KEY in obj):
        if CLASS_KEY in obj:
            cls = _resolve_class(obj[CLASS_KEY], key)
            if classes and not issubclass(cls, tuple(classes)):
                raise ValueError(f"config key {key!r}: {cls.__name__} is not a {_type_name(hint)}")
            return _construct(cls, obj, key)
        if _is_section(current):
            return _apply_section(current, [((k,), v, _join(key, k)) for k, v in obj.items()], key)
        if len(classes) == 1:
            return _construct(classes[0], obj, key)
        raise ValueError(f"config key {key!r}: ambiguous {_type_name(hint)}; add {CLASS_KEY}")
    for member in members:
        if member is not type(None) and not _is_dataclass_type(member):
            with contextlib.suppress(_Mismatch):
                return _convert_one(value, member, key)
    shown = repr(str(value)) if isinstance(value, _Text) else repr(value)
    raise ValueError(f"bad value {shown} for config key {key!r}: expected {_type_name(hint)}")


def _split_list(text: str) -> list[Any]:
    s = text.strip()
    if s in ("", "[]"):
        return []
    if s.startswith("["):
        try:
            parsed = json.loads(s)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
        if not s.endswith("]"):
            raise _Mismatch
        s = s[1:-1]
    return [_Text(part.strip()) for part in s.split(",")]


def _convert_one(value: Any, t: Any, key: str) -> Any:
    text = value.strip() if isinstance(value, _Text) else None
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is Any or t is object:  # JSON if it parses, else the text itself
        try:
            return value if text is None else json.loads(text)
        except json.JSONDecodeError:
            return str(value)
    if t is bool:
        if text is not None and text.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[text.lower()]
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if t is int or t is float:
        try:
            if text is not None:
                return t(text)
        except ValueError:
            raise _Mismatch from None
        if isinstance(value, int if t is int else int | float) and not isinstance(value, bool):
            return t(value)
        raise _Mismatch
    if t is str:
        if text is not None and len(text) >= 2 and text[0] == text[-1] == '"':
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
        if isinstance(value, str):
            return str(value)
        raise _Mismatch
    if origin is Literal:
        for choice in args:
            with contextlib.suppress(_Mismatch):
                got = _convert_one(value, type(choice), key)
                if got == choice and type(got) is type(choice):
                    return choice
        raise _Mismatch
    if origin in (tuple, list):
        items = _split_list(value) if text is not None else value
        if not isinstance(items, list | tuple):
            raise _Mismatch
        variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
        types_ = [args[0] if args else Any] * len(items) if variadic else list(args)
        if len(types_) != len(items):
            raise _Mismatch
        pairs = enumerate(zip(items, types_, strict=True))
        return origin(_convert(v, et, None, f"{key}[{i}]") for i, (v, et) in pairs)
    raise TypeError(f"config key {key!r}: unsupported annotation {t!r}")


# ---- public API --------------------------------------------------------------------------------
def _check_section(config: Any) -> None:
    if not _is_section(config):
        raise ValueError(f"config must be a dataclass instance, got {type(config).__name__}")


def parse_override(text: str) -> tuple[str, str]:
    """Split "a.b=value" into ("a.b", "value"); the value is all after the first '='."""
    key, sep, value = text.partition("=") if isinstance(text, str) else ("", "", "")
    key = key.strip()
    if not sep or not key or not all(key.split(".")):
        raise ValueError(
            f"malformed override {text!r}: expected key=value with a dotted key, "
            "e.g. optimizer.learning_rate=1e-6"
        )
    return key, value


def _leaf(root: type, key: str) -> tuple[dataclasses.Field, Any]:
    """The field of `root` (a dataclass class) that the dotted `key` names, and its annotation."""
    cls, parts = root, key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise _unknown(key, ".".join(parts[:i]), cls)
        field, hint = fields[part], _hints(cls)[part]
        cls = hint
    return field, hint


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_flags(parser: Any, flags: Mapping[str, str], root: type) -> None:
    """One argparse option per `flags` entry (option -> dotted key of a `root` field): a
    shortcut for the override `key=value` (`flag_overrides`), its help the field's
    `metadata["help"]`. A bool field's option takes no value (it sets true); a per-server
    list (tuple[str, ...]) takes "a;b" (or JSON)."""
    for flag, key in flags.items():
        field, hint = _leaf(root, key)
        kwargs = dict(
            dest=_dest(flag), default=None, help=f"{field.metadata.get('help', '')} ({key})"
        )
        if hint is bool:
            kwargs.update(action="store_const", const="true")
        parser.add_argument(flag, **kwargs)


def flag_overrides(args: Any, flags: Mapping[str, str], root: type) -> list[str]:
    """The overrides of the `add_flags` options given in `args` (an argparse namespace)."""
    out = []
    for flag, key in flags.items():
        value = getattr(args, _dest(flag))
        if value is None:
            continue
        if _leaf(root, key)[1] == tuple[str, ...] and not value.lstrip().startswith("["):
            value = json.dumps([part.strip() for part in value.split(";") if part.strip()])
        out.append(f"{key}={value}")
    return out


def apply_overrides(config: C, overrides: Sequence[str]) -> C:
    """A new config with each "dotted.key=value" override applied (see the module doc)."""
    _check_section(config)
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a list of key=value strings, got {overrides!r}")
    entries = []
    for text in overrides:
        key, value = parse_override(text)
        entries.append((tuple(key.split(".")), _Text(value), key))
    return _apply_section(config, entries, "") if entries else config


def config_to_dict(config: Any) -> dict[str, Any]:
    """Nested JSON-serialisable dict of a dataclass tree (tuples become lists)."""
    _check_section(config)
    return _to_json(config, type(config), "")


def _to_json(value: Any, hint: Any, key: str) -> Any:
    if _is_section(value):
        cls = type(value)
        out: dict[str, Any] = {}
        if [m for m in _members(hint) if _is_dataclass_type(m)] != [cls]:
            out[CLASS_KEY] = f"{cls.__module__}:{cls.__qualname__}"
        for name, field_hint in _hints(cls).items():
            out[name] = _to_json(getattr(value, name), field_hint, _join(key, name))
        return out
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [_to_json(v, Any, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _to_json(v, Any, f"{key}[{k!r}]") for k, v in value.items()}
    raise ValueError(f"config key {key!r}: {type(value).__name__} {value!r} is not JSON-able")


def config_from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
    """Inverse of `config_to_dict`: builds `cls` (missing keys take their defaults; unknown
    keys, bad values and section validation errors raise ValueError naming the key)."""
    if not _is_dataclass_type(cls):
        raise ValueError(f"cls must be a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ValueError(f"data must be a dict, got {type(data).__name__}")
    if CLASS_KEY in data:
        named = _resolve_class(data[CLASS_KEY], CLASS_KEY)
        if not issubclass(named, cls):
            raise ValueError(f"{CLASS_KEY} {data[CLASS_KEY]!r} is not a {cls.__name__}")
        cls = named
    return _construct(cls, data, "")
