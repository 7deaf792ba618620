"""The configuration from a YAML file and `--set KEY=VALUE` overrides, and `hvdtrain config`'s
commented listing of every key."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import yaml

from hvdtrain.config.coercion import homes_of
from hvdtrain.config.schema import Config, key_homes, section_types_of_config
from hvdtrain.errors import UserError


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping, which PyYAML reads as the second alone: a `train:` section added
    at a file's end lost every key of the first, silently."""

    def __init__(self, key: str, first_line: int, second_line: int):
        super().__init__(f"key '{key}' twice")
        self.key, self.lines = key, (first_line, second_line)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with floats as YAML 1.2 (and Python, and JSON) write them: `1e-3` and `5E-4`
    are numbers, not the strings YAML 1.1 makes of a float without a dot. A typed key survives that (its
    coercion), but a factory's own argument (`optim.args.eps: 1e-8`) reached it as a string. A key given
    twice in one mapping is an error (DuplicateKey), not the second alone."""

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        """Each mapping as the file writes it, before a `<<:` merge elsewhere adds keys to it (merged keys
        may repeat its own: the file's own win)."""
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKey(key_node.value, seen[key], line)
                seen[key] = line
        return node


class _Dumper(yaml.SafeDumper):
    """Writes what `_Loader` reads back the same: text that would read as a float (`'1e3'`) is quoted."""


# A float without a dot: 1e-3, 5E4, .5e3 (an exponent of 1 or 2 digits: a hash such as 7e03841 stays text).
_FLOAT_WITHOUT_A_DOT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]{1,2}$")
for _resolving in (_Loader, _Dumper):
    _resolving.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_A_DOT, list("-+.0123456789"))


def read_yaml(text: str) -> Any:
    """YAML text as hvdtrain reads it (config files, --set values, saved runs)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def write_yaml(data: Any, **options: Any) -> str:
    """YAML text that `read_yaml` reads back as `data`."""
    return yaml.dump(data, Dumper=_Dumper, **options)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Reads a YAML file (safe loader) and applies overrides on top."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file '{path}' does not exist: check the path given to --config")
        try:
            raw = read_yaml(path.read_text()) or {}
        except DuplicateKey as err:
            raise UserError(f"config file '{path}' has {err.key}: twice in one mapping (lines {err.lines[0]} and "
                            f"{err.lines[1]}), and YAML would keep only the second: merge them into one") from err
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"config file '{path}' is not valid YAML{where}: fix its syntax") from err
        if not isinstance(raw, dict):
            raise UserError(f"config file '{path}' must hold a mapping of sections (data, model, ...), not {type(raw).__name__}")
        if "data.name" not in (overrides or {}):
            _data_beside_the_config_file(path, raw.get("data"))
    return Config.from_dict(raw, overrides)


def _data_beside_the_config_file(path: Path, data: Any) -> None:
    """Relative paths are the working directory's, as on the command line; a data path found only next to
    the config file is that mistake (the job started from elsewhere), said before anything starts."""
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or ":" in name or not ("/" in name or Path(name).suffix):
        return
    relative = Path(name).expanduser()
    if relative.is_absolute() or relative.exists() or not (path.parent / relative).exists():
        return
    raise UserError(f"data.name '{name}' in {path} is not in the working directory ({Path.cwd()}), but is next to the "
                    f"config file: paths are the working directory's; run from {path.parent.resolve()}, or write it "
                    f"as {(path.parent / relative).resolve()}")


def saved_run_overrides(overrides: dict[str, Any], device: str) -> dict[str, Any]:
    """What `evaluate`, `predict` and `export` (the commands and their Python twins) lay over a saved
    run's config: the given keys, the device, and the training-only keys switched off."""
    return {**overrides, "train.device": device, "run.resume": False, "run.overwrite": False,
            "train.elastic": False, "train.compile": False}


def default_part(part: str | None, other_data: bool) -> str:
    """The part of the data to read after fit: as asked, else all of other data, else fit's validation split."""
    return part or ("all" if other_data else "val")


def parse_assignment(text: str) -> tuple[str, Any]:
    """`section.key=value` from --set; the value is read as YAML (so 3, 0.1, true, null work)."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        homes = homes_of(key.strip(), key_homes())
        if sep and len(homes) == 1:  # the section left out: `--set batch_size=64`
            raise UserError(f"--set expects section.key=value: did you mean --set {homes[0]}={value}?")
        raise UserError(f"--set expects section.key=value (for example data.batch_size=32), got '{text}'")
    try:
        parsed = read_yaml(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def describe() -> str:
    """The default config as YAML with each field's docstring as a comment."""
    lines = ["# hvdtrain fit configuration: every key with its default.", ""]
    defaults = Config().to_dict()
    for section, section_type in section_types_of_config().items():
        lines.append(f"{section}:")
        docs = _field_docs(section_type)
        for name, value in defaults[section].items():
            for doc_line in docs.get(name, "").splitlines():
                lines.append(f"  # {doc_line.strip()}")
            dumped = write_yaml({name: value}, default_flow_style=True).strip()[1:-1]
            lines.append(f"  {dumped}")
        lines.append("")
    return "\n".join(lines)


def _field_docs(section_type: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) read from the source."""
    tree = ast.parse(inspect.getsource(section_type))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(str(following.value.value))
    return docs
