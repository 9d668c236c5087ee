"""Strict parsing of JSON objects into frozen dataclasses.

Unknown keys, wrong types and values outside a `Literal` are rejected with a
:class:`ConfigError` naming the dotted key, the value and the fix. Each dataclass may
define ``__post_init__`` checks of its own (raising :class:`ConfigError` too).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from ds_recycle.config.errors import ConfigError

T = TypeVar("T")


def parse_dataclass(cls: type[T], data: Any, path: str) -> T:
    """Build ``cls`` from the JSON object ``data`` found at ``path`` (for messages)."""
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a JSON object, got {type(data).__name__} {data!r}",
                          f"write '{path}' as {{...}}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{path}.{key}", "unknown key", f"remove it or correct it ({hint})")
    hints = get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], data[name], f"{path}.{name}") for name in fields if name in data}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"{value!r} is not one of {list(choices)}",
                              f"set it to one of {', '.join(repr(c) for c in choices)}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a JSON list, got {value!r}", "write it as [...]")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, f"expected {len(args)} items, got {value!r}",
                              f"write it as a list of {len(args)} items")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif tp is typing.Any:
        ok = True
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported config type {tp!r} at {path}")
    if not ok:
        raise ConfigError(path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}",
                          f"give '{path.rsplit('.', 1)[-1]}' a {tp.__name__} value")
    return value


def to_jsonable(obj: Any) -> Any:
    """The resolved config as plain JSON data (for the start-up dump and wandb)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_jsonable(v) for v in obj]
    return obj


def load_json_object(path: str) -> dict[str, Any]:
    """The JSON object in the file at ``path`` (a DeepSpeed config); a :class:`ConfigError` names what is wrong."""
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("--deepspeed_config", f"no file at {path}", "pass the path of a JSON config") from None
    except json.JSONDecodeError as e:
        raise ConfigError("--deepspeed_config", f"{path} is not valid JSON ({e})", "fix the JSON syntax") from None
    if not isinstance(loaded, dict):
        raise ConfigError("<top>", f"{path} is not a JSON object", "write the config as {...}")
    return loaded
