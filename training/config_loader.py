"""Loading run configs: YAML files (with `extends:`) plus `key=value` overrides, parsed by each
field's type into the dataclasses of training/config.py (or another root class such as
training.finetune_config.FinetuneConfig), and the resolved config written back as YAML.

    cfg = load_run_config("training/configs/t5_base_c4.yaml", ["optim.base_lr=1e-2", "model.preset=small"])

A YAML file holds the sections of the root class (any key left out keeps its default). `extends:
other.yaml` (a path relative to the file) inherits another config; the file's own keys win, section
by section. Overrides name a key as `section.field=value` (or `field=value` for top-level keys); the
value is parsed by the field's type: ints, floats (`2e-2`), bools (`true/false`), strings,
`null`/`none` for optional fields, comma-separated tuples (`optim.betas=0.9,0.999`), lists (typed
`tuple[X, ...]`; of records when X is a dataclass) in YAML flow style (`data.sources=[{dir: a}]`). Unknown keys
and ill-typed values are errors that list what is valid.

Shipped files are found from any working directory: a config path or `data.tokenizer` that does
not exist relative to the working directory but does relative to the repository (the configs in
training/configs/, assets/t5/spiece.model) is taken from the repository, as an absolute path.

`python -m training.config_loader CONFIG.yaml [key=value ...]` prints the resolved config.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from data_prep.invocation import command_name
from training.cli_errors import run_main
from training.config import ConfigError, RunConfig, section_types

REPO_ROOT = Path(__file__).resolve().parents[1]
# Config fields naming a file the repository ships a default of (section, field).
SHIPPED_FILE_FIELDS = (("data", "tokenizer"),)


def shipped_path(path: str | Path) -> Path:
    """`path` as given when it exists (absolute, or relative to the working directory); else, for a
    relative path that exists inside the repository (a shipped config or asset), that file,
    absolute; else `path` unchanged (the caller reports it missing)."""
    p = Path(path)
    if p.exists() or p.is_absolute() or not (REPO_ROOT / p).exists():
        return p
    return REPO_ROOT / p

# ------------------------------------------------------------------------------------------------
# Typed parsing: YAML values and command-line strings
# ------------------------------------------------------------------------------------------------

_NULL_WORDS = ("null", "none", "~")
_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "tuple[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to type `tp`; ConfigError if it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args:
            if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_WORDS):
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}")
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        return _coerce_records(value, typing.get_args(tp)[0], key)
    if origin is tuple:
        args = typing.get_args(tp)
        items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(
                f"{key}={value!r} must be {len(args)} comma-separated values ({_type_name(tp)}), "
                f"e.g. {key}=" + ",".join("0.9" if a is float else "1" for a in args)
            )
        return tuple(_coerce(v, a, key) for v, a in zip(items, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
            return value.strip().lower() in _TRUE_WORDS
        raise ConfigError(f"{key}={value!r} is not a bool; use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip().replace("_", "")
            try:
                return int(text)
            except ValueError:
                try:  # `1e4` style integers
                    as_float = float(text)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ConfigError(f"{key}={value!r} is not an int")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `2e-2` (no dot) as a string: parse it here.
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not a float (e.g. 2e-2 or 0.02)")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} is not a string")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _coerce_records(value: Any, item_type: Any, key: str) -> tuple:
    """A `tuple[X, ...]` field: a YAML list, or on the command line the same list in YAML flow style
    (`data.sources='[{dir: a, weight: 3}, {dir: b, weight: 1}]'`); dataclass items come from mappings."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r} is not a YAML list; write it as [item, item, ...]") from None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a list, e.g. {key}=[...] or a YAML list under {key}")
    if dataclasses.is_dataclass(item_type):
        return tuple(item if isinstance(item, item_type) else _build_section(item_type, item, f"{key}[{i}]")
                     for i, item in enumerate(value))
    return tuple(_coerce(item, item_type, f"{key}[{i}]") for i, item in enumerate(value))


def _section_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _valid_keys_message(section: str | None, valid: typing.Iterable[str]) -> str:
    where = f"section `{section}`" if section else "the top level"
    return f"valid keys in {where}: {', '.join(sorted(valid))}"


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"`{section}` must be a mapping of keys to values, got {values!r}")
    fields = _section_fields(cls)
    unknown = [k for k in values if k not in fields]
    if unknown:
        raise ConfigError(f"unknown key {section}.{unknown[0]}; " + _valid_keys_message(section, fields))
    kwargs = {k: _coerce(v, fields[k], f"{section}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def from_dict(data: dict[str, Any], root: type = RunConfig) -> Any:
    """Build a validated config of class `root` (RunConfig by default) from a nested dict
    (missing keys keep their defaults)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a run config must be a mapping of sections, got {type(data).__name__}")
    top_fields = _section_fields(root)
    sections = section_types(root)
    unknown = [k for k in data if k not in top_fields]
    if unknown:
        raise ConfigError(f"unknown key `{unknown[0]}`; " + _valid_keys_message(None, top_fields))
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in sections:
            kwargs[key] = _build_section(sections[key], value or {}, key)
        else:
            kwargs[key] = _coerce(value, top_fields[key], key)
    return root(**kwargs)


# ------------------------------------------------------------------------------------------------
# YAML files (with `extends:`) and overrides
# ------------------------------------------------------------------------------------------------


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `update` wins. Sections merge key by key."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"`extends` cycle: {chain}")
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in (REPO_ROOT / "training" / "configs").glob("*.yaml")))
        raise ConfigError(f"config file {path} does not exist; the shipped run configs in "
                          f"{REPO_ROOT / 'training' / 'configs'}: {shipped}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run config must be a YAML mapping, got {type(data).__name__}")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: `extends` must be a relative path to another YAML, got {parent!r}")
    base = _read_yaml_tree(path.parent / parent, (*seen, path))
    return _merge(base, data)


def _parse_override(item: str) -> tuple[list[str], str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. optim.base_lr=1e-2)")
    key, value = item.split("=", 1)
    key = key.strip().lstrip("-")  # tolerate `--optim.base_lr=...`
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    return key.split("."), value


def _apply_override_to_dict(data: dict[str, Any], item: str, root: type = RunConfig) -> None:
    parts, value = _parse_override(item)
    top_fields = _section_fields(root)
    sections = section_types(root)
    head = parts[0]
    if head not in top_fields:
        raise ConfigError(
            f"override {item!r}: unknown key `{head}`; " + _valid_keys_message(None, top_fields)
        )
    if head in sections:
        fields = _section_fields(sections[head])
        if len(parts) != 2 or parts[1] not in fields:
            name = ".".join(parts[1:]) or "(missing)"
            raise ConfigError(
                f"override {item!r}: unknown key {head}.{name}; " + _valid_keys_message(head, fields)
            )
        key = parts[1]
        data.setdefault(head, {})
        if data[head] is None:
            data[head] = {}
        data[head][key] = _coerce(value, fields[key], f"{head}.{key}")
    else:
        if len(parts) != 1:
            raise ConfigError(f"override {item!r}: `{head}` is a top-level value, not a section")
        data[head] = _coerce(value, top_fields[head], head)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """A new config of the same class with `section.key=value` overrides applied (validated as a whole)."""
    data = cfg.to_dict()
    for item in overrides:
        _apply_override_to_dict(data, item, type(cfg))
    return from_dict(data, type(cfg))


def load_run_config(
    yaml_path: str | Path | None, overrides: list[str] | None = None, root: type = RunConfig
) -> Any:
    """Defaults <- YAML file (and the files it `extends`) <- overrides, validated once at the end.

    Validation runs on the merged result, so an override can repair a value that is only invalid
    in combination (e.g. raise total_steps and warmup_steps together).
    """
    data = _read_yaml_tree(shipped_path(yaml_path)) if yaml_path is not None else {}
    for item in overrides or []:
        _apply_override_to_dict(data, item, root)
    for section, key in SHIPPED_FILE_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and value:
            data[section][key] = str(shipped_path(value))
    try:
        return from_dict(data, root)
    except ConfigError as e:
        where = f" (from {yaml_path}" + (f" with overrides {overrides}" if overrides else "") + ")"
        raise ConfigError(f"{e}{where if yaml_path else ''}") from None


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: tmp file + rename); loadable by load_run_config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("# Resolved t5ds run config (defaults <- YAML <- overrides).\n")
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False, default_flow_style=False)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Print the resolved run config of CONFIG.yaml with overrides (a bad config raises ConfigError)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {command_name()} CONFIG.yaml [section.key=value ...]")
        return 0
    path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    cfg = load_run_config(path, overrides)
    yaml.safe_dump(cfg.to_dict(), sys.stdout, sort_keys=False, default_flow_style=False)
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
