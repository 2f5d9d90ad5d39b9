"""`key=value` overrides on a config, typed by the dataclasses' own annotations.

    apply_overrides(cfg, ["max_steps=20", "model.d_model=64", "lr=1e-3", "strategy=fsdp_tp"])
    apply_overrides(cfg, {"model.remat": "full", "data.max_bytes": None})

A key is a dotted path through the nested dataclasses (`model.n_layers`) or a bare field name that is unique across
them (`n_layers`, `max_steps`). Values are parsed by the field's type: bool (true/false/yes/no/on/off/1/0), int,
float, str, Literal (one of its values), Optional (none/null/empty), and tuple or list of those (comma-separated, or
a bracketed list). An unknown key suggests the closest ones; a value that does not fit names the key, its type and the
value.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from typing import Any, Literal

from jaxperf.config.schema import ConfigError, field_types

_NONE_WORDS = ("none", "null", "")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def keys(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: annotation} of every leaf field of a (nested) config dataclass."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        tp = field_types(type(cfg))[f.name]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(keys(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


def resolve_key(key: str, known: dict[str, Any]) -> str:
    """The dotted key a (possibly bare) key names; ConfigError for an unknown or ambiguous one."""
    if key in known:
        return key
    bare = [k for k in known if k.rsplit(".", 1)[-1] == key]
    if len(bare) == 1:
        return bare[0]
    if len(bare) > 1:
        raise ConfigError(f"config key {key!r} is ambiguous: say one of {', '.join(bare)}")
    names = list(dict.fromkeys([*known, *sorted({k.rsplit(".", 1)[-1] for k in known})]))
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}.{hint} (keys are the fields of jaxperf.config.TrainConfig and its "
                      f"sections)")


def type_name(tp: Any) -> str:
    """A short readable name for an annotation: int, bool | None, 'gpt2' | 'llama', tuple[int, ...]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (tuple, list):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(ValueError):
    """A value that does not fit one alternative of a type (the caller reports the key)."""


def _literal(key: str, value: Any, allowed: tuple) -> Any:
    if value in allowed:
        return value
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown {key} {value!r}; choose one of {', '.join(str(a) for a in allowed)}.{hint}")


def _from_text(key: str, text: str, tp: Any) -> Any:
    """Parse `text` as a value of type `tp`; _Mismatch when it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in _NONE_WORDS:
            return None
        options = [a for a in args if a is not type(None)]
        literals = [a for a in options if typing.get_origin(a) is Literal]
        for option in options:
            try:
                return _from_text(key, text, option)
            except (_Mismatch, ConfigError):
                continue
        if literals:  # the value is meant to be one of the choices: say which ones
            return _literal(key, text.strip(), typing.get_args(literals[0]))
        raise _Mismatch(text)
    if origin is Literal:
        return _literal(key, text.strip(), args)
    if origin in (tuple, list):
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                items = [str(x) for x in json.loads(stripped)]
            except json.JSONDecodeError:
                raise _Mismatch(text) from None
        else:
            items = [x for x in stripped.split(",") if x.strip()]
        elem = args[0] if args else str
        values = [_from_text(key, x, elem) for x in items]
        return tuple(values) if origin is tuple else values
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise _Mismatch(text)
    if tp is int:
        try:
            as_float = float(text)
        except ValueError:
            raise _Mismatch(text) from None
        if not as_float.is_integer():
            raise _Mismatch(text)
        return int(as_float)
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise _Mismatch(text) from None
    if tp is str or tp is Any:
        return text
    raise _Mismatch(text)


def _from_value(key: str, value: Any, tp: Any) -> Any:
    """Check a Python value against type `tp` (ints are accepted for floats); _Mismatch when it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _from_value(key, value, option)
            except _Mismatch:
                continue
        raise _Mismatch(value)
    if origin is Literal:
        if isinstance(value, str):
            return _literal(key, value, args)
        raise _Mismatch(value)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise _Mismatch(value)
        elem = args[0] if args else Any
        values = [_from_value(key, v, elem) for v in value]
        return tuple(values) if origin is tuple else values
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch(value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(value)
    return value


def parse_value(key: str, value: Any, tp: Any) -> Any:
    """`value` (text from the command line, or a Python value) as type `tp`, or ConfigError naming key and type."""
    try:
        if isinstance(value, str):
            return _from_text(key, value, tp)
        return _from_value(key, value, tp)
    except _Mismatch:
        shown = repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
        raise ConfigError(f"config key {key!r} wants {type_name(tp)}, got {shown}") from None


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """["a=1", "b.c=x"] -> {"a": "1", "b.c": "x"} (later items win)."""
    pairs: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (for example max_steps=20)")
        k, v = item.split("=", 1)
        pairs[k.strip()] = v
    return pairs


def _replace(cfg: Any, path: list[str], value: Any) -> Any:
    head, rest = path[0], path[1:]
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _replace(getattr(cfg, head), rest, value)})


def apply_overrides(cfg: Any, overrides: dict[str, Any] | list[str] | tuple[str, ...]) -> Any:
    """`cfg` with `{"model.d_model": 64}` or `["model.d_model=64", ...]` applied, each key and value checked."""
    if isinstance(overrides, (list, tuple)):
        overrides = parse_overrides(overrides)
    known = keys(cfg)
    for raw_key, value in overrides.items():
        key = resolve_key(raw_key, known)
        cfg = _replace(cfg, key.split("."), parse_value(key, value, known[key]))
    return cfg
