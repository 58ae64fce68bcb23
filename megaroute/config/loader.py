"""Strict YAML loading: single-parent inheritance, dotted overrides, typed construction.

    cfg = load_config("configs/mod_1b.yaml", ["model.n_layers=4", "routing.capacity=0.25"])

Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the key path,
before anything expensive happens. `to_yaml(cfg)` writes a file that reloads to an equal object.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
import types
import typing
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from .schema import Config, ConfigError

BASE_KEY = "base"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` / `6e-05` / `1e20` as floats.

    PyYAML follows YAML 1.1, where a float needs a dot, so `lr: 1e-4` or `optim.lr=3e-4` would
    load as the *string* '1e-4' and be rejected. The dumper shares the resolver so a string
    that looks like such a number (e.g. name '1e5') is quoted and round-trips as a string.

    It also rejects duplicate keys, which PyYAML silently resolves to the last one (a second
    `model:` block would otherwise drop every key of the first).
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # unhashable key: let the base class report it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


class _Dumper(yaml.SafeDumper):
    pass


_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))


def _suggest(key: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_yaml(path: str) -> dict:
    if os.path.isdir(path):
        raise ConfigError("", f"{path} is a directory, not a config file")
    if not os.path.isfile(path):
        raise ConfigError("", f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.load(f, Loader=_Loader)
        except yaml.YAMLError as e:
            raise ConfigError("", f"{path} is not valid YAML: {e}") from None
        except UnicodeDecodeError:  # a checkpoint or other binary file passed as the config
            raise ConfigError("", f"{path} is not a YAML config (not UTF-8 text)") from None
    if data is None:  # an empty file, or only comments: most likely a truncated or wrong file
        raise ConfigError("", f"{path} is empty (no YAML content, or only comments): a config file must contain "
                              "a mapping of sections; write `{}` for all defaults")
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must contain a mapping at top level, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_raw(path: str, _seen: tuple[str, ...] = ()) -> dict:
    """Read a YAML file and resolve its `base:` chain (paths relative to the including file)."""
    real = os.path.realpath(path)
    if real in _seen:
        chain = " -> ".join(_seen + (real,))
        raise ConfigError(BASE_KEY, f"inheritance cycle: {chain}")
    data = _read_yaml(path)
    parent = data.pop(BASE_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(BASE_KEY, f"must be a path to one parent YAML file, got {parent!r}")
    parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
    if not os.path.isfile(parent_path):
        raise ConfigError(BASE_KEY, f"parent config file not found: {parent_path} (named in {path})")
    return _deep_merge(load_raw(parent_path, _seen + (real,)), data)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply `a.b.c=value` strings; values are parsed as YAML scalars/lists."""
    out = _deep_merge({}, raw)
    for item in overrides:
        if "=" not in item:
            hint = " (a config file goes after --config)" if item.endswith((".yaml", ".yml")) else ""
            raise ConfigError(item, f"override must look like key.path=value{hint}")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(key, "override key has an empty component")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section; cannot override a sub-key")
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = _parse_scalar(value)
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp`; returns the value in canonical form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a section (mapping), got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = _suggest(str(value), [str(c) for c in choices])
            raise ConfigError(path, f"must be one of {', '.join(map(repr, choices))}; got {value!r}{hint}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            # Allow 1e6-style floats that are whole numbers (YAML reads 1e6 as a float).
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


# Keys renamed since they were released: the old name gets an error that says the new one.
RENAMED = {"routing.gate": "routing.router_weight",
           "routing.depth_gate.threshold_momentum": "routing.threshold_momentum"}


def _build(cls: type, data: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if full in RENAMED:
            raise ConfigError(full, f"was renamed to {RENAMED[full]}")
        if key not in hints:
            raise ConfigError(full, f"unknown key{_suggest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    return _build(Config, data, "").validate()


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    raw = load_raw(path) if path else {}
    return config_from_dict(apply_overrides(raw, overrides))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False)


def save_config(cfg: Config, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)


def flatten(cfg: Config) -> dict[str, Any]:
    """Dotted key -> leaf value, e.g. {'model.d_model': 384, ...} (MLflow params)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            out[prefix] = node

    walk(to_dict(cfg), "")
    return out


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]
