"""From raw YAML values to typed fields: dotted overrides merged in, unknown keys named with a
close match, numbers and booleans given as text converted. Knows no section: the schema passes its
types in."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from hvdtrain.errors import UserError


# Other tools' names for keys (Lightning, Hugging Face's Trainer, Keras), to point at ours.
OTHER_TOOLS_NAMES = {
    "learning_rate": "lr", "max_epochs": "epochs", "num_epochs": "epochs", "num_train_epochs": "epochs",
    "scheduler": "schedule", "lr_scheduler": "schedule", "lr_scheduler_type": "schedule",
    "gradient_clip_val": "clip_grad_norm", "max_grad_norm": "clip_grad_norm", "clipnorm": "clip_grad_norm",
    "accumulate_grad_batches": "accumulate", "gradient_accumulation_steps": "accumulate",
    "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
    "output_dir": "dir", "default_root_dir": "dir", "run_dir": "dir",
}


# Hydra's own keys in a config, and how hvdtrain says the same.
HYDRA_KEYS = {
    "_target_": "Hydra's name for a class to build; hvdtrain's is {section}name, a package.module:function (or "
                ":Class) given its arguments from {section}args",
    "_target_ elsewhere": "Hydra's name for a class to build; in hvdtrain the data, model, task and optim "
                          "sections each name theirs (model.name, a package.module:function, with model.args)",
    "defaults": "Hydra's list of other config files; hvdtrain reads one file (--config), its keys overridden by "
                "flags and --set",
}
FACTORY_SECTIONS = ("data.", "model.", "task.", "optim.")  # the sections whose `name` may be a factory, with `args`


def homes_of(name: str, homes: dict[str, list[str]]) -> list[str]:
    """The full names of key `name`, or of ours for another tool's name (`learning_rate`: `optim.lr`)."""
    return homes.get(name) or homes.get(OTHER_TOOLS_NAMES.get(name, ""), [])


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any],
                    homes: dict[str, list[str]] | None = None) -> dict[str, Any]:
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            full = homes_of(dotted, homes or {})
            example = f"did you mean '{full[0]}'?" if len(full) == 1 else "e.g. data.batch_size"
            raise UserError(f"override '{dotted}' must be section.key, {example}")
        target = merged.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
    return merged


def reject_unknown(values: dict[str, Any], known: Any, prefix: str, homes: dict[str, list[str]] | None = None) -> None:
    """`homes`: each key's full names in every section, to point a key put in the wrong section at its own."""
    for key in values:
        if key not in known:
            raise UserError(f"config key '{prefix}{key}' does not exist: {unknown_key_hint(str(key), known, prefix, homes or {})}")


def unknown_key_hint(key: str, known: Any, prefix: str, homes: dict[str, list[str]]) -> str:
    """Where the key is in another section (or under another tool's name), else the closest key here,
    else the closest anywhere, else every key here."""
    if key == "_target_" and prefix in FACTORY_SECTIONS:
        return HYDRA_KEYS[key].format(section=prefix)
    if key == "_target_" or (key == "defaults" and not prefix):
        return HYDRA_KEYS["_target_ elsewhere" if key == "_target_" else key]
    elsewhere = homes_of(key, homes)
    if not elsewhere:
        close = difflib.get_close_matches(key, list(known), n=1)
        if close:
            return f"did you mean '{prefix}{close[0]}'?"
        close = difflib.get_close_matches(key, list(homes), n=1)
        elsewhere = homes[close[0]] if close else []
    if elsewhere:
        names = [f"'{name}'" for name in elsewhere]
        return f"did you mean {' or '.join(filter(None, [', '.join(names[:-1]), names[-1]]))}?"
    return f"known keys: {', '.join(prefix + k for k in known)}"


def build_section(section_type: type, values: dict[str, Any], section: str,
                  homes: dict[str, list[str]] | None = None) -> Any:
    hints = typing.get_type_hints(section_type)
    values = _nest_dotted(values, {key for key, hint in hints.items() if typing.get_origin(hint) is dict})
    reject_unknown(values, hints, f"{section}.", homes)
    kwargs = {key: _coerce(value, hints[key], f"{section}.{key}") for key, value in values.items()}
    return section_type(**kwargs)


def _nest_dotted(values: dict[str, Any], mappings: set[str]) -> dict[str, Any]:
    """`args.depth: 50` (from `--set model.args.depth=50`) set inside the mapping field `args`, keeping
    the other keys it has; a dotted key under any other field stays as it is, to be named unknown."""
    nested = {key: value for key, value in values.items() if key.partition(".")[0] not in mappings or "." not in key}
    for key, value in values.items():
        field, _, path = key.partition(".")
        if path and field in mappings:
            nested[field] = _set_in(nested.get(field), path.split("."), value)
    return nested


def _set_in(mapping: Any, path: list[str], value: Any) -> dict[str, Any]:
    """A copy of `mapping` (a new one where it is none) with `value` at `path`."""
    copy = dict(mapping) if isinstance(mapping, dict) else {}
    copy[path[0]] = _set_in(copy.get(path[0]), path[1:], value) if len(path) > 1 else value
    return copy


def _plain(value: Any, key: str) -> Any:
    """A factory's argument as YAML keeps it in the run's config.yaml (a tuple becomes a list)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{key}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        return {name: _plain(item, f"{key}.{name}") for name, item in value.items()}
    raise UserError(f"config key '{key}' must be plain data (a number, text, true/false, null, a list or a mapping "
                    f"with text keys), which the run's config.yaml keeps; got {type(value).__name__}")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Checks one value against its field type; numbers and booleans given as text are converted."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is dict:  # a factory's own arguments, by name
        if value is None:  # `args:` left empty in YAML
            return {}
        if not isinstance(value, dict):
            raise UserError(f"config key '{key}' must be a mapping of argument names to values, got {value!r}")
        return _plain(value, key)
    if origin is typing.Union and type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if origin is Literal:
        if value not in args and str(value) in args:  # `precision: 32` in YAML is an int
            value = str(value)
        if bool in map(type, args) and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # a boolean among the choices, given as text
        if value not in args:
            raise UserError(f"config key '{key}' must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"config key '{key}' must be true or false, got {value!r}")
    if annotation in (int, float):
        accepted = (int,) if annotation is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return annotation(value)
        if annotation is int and isinstance(value, float) and value.is_integer():  # 1e4 steps, read as a float
            return int(value)
        if isinstance(value, str):
            try:
                return annotation(value)
            except ValueError:
                pass
        raise UserError(f"config key '{key}' must be {'an integer' if annotation is int else 'a number'}, got {value!r}")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"config key '{key}' must be text, got {value!r}")
    raise TypeError(f"unsupported config type {annotation!r} for {key}")


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise UserError(f"config key '{key}' {message}")
