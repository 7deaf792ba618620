"""`package.module:function` factories for users' own data sets, models, tasks and optimizers: each
is given the names it declares, and its own arguments from the config (`model.args`, ...).

A factory runs the user's code by design: only point hvdtrain at code you trust.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from typing import Any, Callable, Mapping, Sequence

from hvdtrain.errors import SHOWS_THE_TRACEBACK, UserError, where


def is_factory_path(text: str) -> bool:
    module, sep, function = text.partition(":")
    return bool(sep and module and function)


def colon_hint(name: str) -> str:
    """For `package.module.function` where `package.module:function` was meant (its top package can be
    imported): the name to give instead."""
    parts = name.split(".")
    if ":" in name or len(parts) < 2 or not all(part.isidentifier() for part in parts):
        return ""
    try:
        found = importlib.util.find_spec(parts[0]) is not None  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        found = False
    found = found or _in_the_current_directory(parts[0])  # where _import_module finds it too
    return f" (a module's function is named with a colon: '{'.'.join(parts[:-1])}:{parts[-1]}')" if found else ""


def _in_the_current_directory(top: str) -> bool:
    """Whether `top` is a module or a package (not any folder) of the current directory."""
    import os

    return os.path.isfile(f"{top}.py") or os.path.isfile(os.path.join(top, "__init__.py"))


def resolve_factory(path: str, what: str, require_callable: bool = True) -> Callable[..., Any]:
    """Imports `package.module:function`; a clear error when it does not import."""
    if not is_factory_path(path):
        raise UserError(f"{what} factory '{path}' must look like package.module:function{colon_hint(path)}")
    module_name, _, attribute = path.partition(":")
    if "/" in module_name or module_name.endswith(".py"):  # a file named where its module was meant
        folder, _, file_name = module_name.rpartition("/")
        raise UserError(f"{what} factory '{path}' names a file: name its module and put its folder on PYTHONPATH "
                        f"(PYTHONPATH={folder or '.'} and {file_name.removesuffix('.py')}:{attribute})")
    try:
        module = _import_module(module_name)
    except ModuleNotFoundError as err:
        raise UserError(
            f"{what} factory '{path}': module '{err.name}' not found; install it or add its folder to PYTHONPATH"
        ) from err
    except Exception as err:  # the user's module raised while importing
        raise UserError(f"{what} factory '{path}': importing '{module_name}' failed: {type(err).__name__}: {err}") from err
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            if module_name == "hvdtrain.api":  # an object handed to hvdtrain.fit lives in that script alone
                raise UserError(f"the {what} of this run was a Python object given to hvdtrain.fit: it cannot be "
                                "rebuilt here; give it again from Python, or use a package.module:function")
            raise UserError(f"{what} factory '{path}': '{module_name}' has no attribute '{attribute}'"
                            f"{_shadowed_hint(module_name, module, part) if target is module else ''}")
        target = getattr(target, part)
    if require_callable and not callable(target):
        raise UserError(f"{what} factory '{path}' is not callable")
    return target


def _import_module(module_name: str) -> Any:
    """The module, or else the one of that name in the current directory, as `python -m hvdtrain` (and
    `uvicorn main:app`) would find it: the `hvdtrain` command's path starts at its own folder instead."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        import os
        import sys

        top, here = module_name.partition(".")[0], os.getcwd()
        if err.name != top or not _in_the_current_directory(top) or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # last: a module of the current directory never hides an installed one
        return importlib.import_module(module_name)


def _shadowed_hint(module_name: str, module: Any, attribute: str) -> str:
    """Where the module imported is not the user's file of that name on the path that defines `attribute`
    (their `io.py` or `json.py`, whose name Python's own module, imported first, already holds): which was
    imported."""
    import os
    import re
    import sys
    from pathlib import Path

    imported = getattr(module, "__file__", None)
    relative = Path(*module_name.split("."))
    defines = re.compile(rf"^(def|class)\s+{re.escape(attribute)}\b|^{re.escape(attribute)}\s*[:=]", re.M)
    for entry in sys.path:
        for candidate in (Path(entry or ".") / relative.with_suffix(".py"), Path(entry or ".") / relative / "__init__.py"):
            if not candidate.is_file() or (imported and os.path.exists(imported) and os.path.samefile(candidate, imported)):
                continue
            if defines.search(candidate.read_text(errors="replace")):
                return (f" (the '{module_name}' imported is {imported or 'built into Python'}, not {candidate}, which "
                        "defines it: another module of that name came first; rename yours)")
    return ""


def call_factory(path: str, what: str, offered: dict[str, Any], unknown: dict[str, str] | None = None, *,
                 args: Mapping[str, Any] | None = None, args_key: str = "", convention: Sequence[str] | None = None
                 ) -> Any:
    """Imports and calls a factory with the offered keyword arguments it declares, and its own `args`
    (the config's `args_key`, e.g. model.args), which win over offered ones of the same name.

    A factory taking `**kwargs` gets of the offered ones only those in `convention` (all when None):
    what such factories expect by convention (num_classes for a model), not every name hvdtrain knows.
    An offered value of None is not passed (the factory's default applies); when the factory
    requires it, the error says why it is unknown: `unknown[name]`.
    """
    factory = resolve_factory(path, what)
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = _named(parameters)
    args = dict(args or {})
    _check_names(path, what, parameters, args, args_key)
    for name, why in (unknown or {}).items():
        parameter = parameters.get(name)
        if (offered.get(name) is None and name not in args and parameter is not None
                and parameter.default is inspect.Parameter.empty):
            raise UserError(f"{what} factory '{path}' takes {name}, but {why}")
    passed = named if not takes_any else [*named, *(offered if convention is None else convention)]
    kwargs = {k: v for k, v in offered.items() if v is not None and k in passed}
    kwargs.update(args)
    missing = [name for name in named if parameters[name].default is inspect.Parameter.empty and name not in kwargs]
    if missing and args_key:
        raise UserError(f"{what} factory '{path}' needs {', '.join(missing)}: give "
                        f"{'it' if len(missing) == 1 else 'them'} in {args_key} (--set {args_key}.{missing[0]}=...)")
    try:
        return factory(**kwargs)
    except Exception as err:
        raise UserError(f"{what} factory '{path}' raised {type(err).__name__}: {err}{where(err)} "
                        f"({SHOWS_THE_TRACEBACK})") from err


def unstarted_library(err: UserError) -> str:
    """'Horovod' or 'torch.distributed' where a factory failed for using one that this process has not
    started (a script's own hvd.DistributedOptimizer, or DDP, under another engine), else ''."""
    cause = str(err.__cause__)
    return ("Horovod" if "Horovod has not been initialized" in cause else
            "torch.distributed" if "process group has not been initialized" in cause else "")


def with_args(path: str, what: str, target: Callable[..., Any], args: Mapping[str, Any], args_key: str
              ) -> Callable[..., Any]:
    """`target` (a function or class) with its own arguments from the config bound by name."""
    _check_names(path, what, inspect.signature(target).parameters, args, args_key)
    return functools.partial(target, **args)


def _named(parameters: Mapping[str, inspect.Parameter]) -> list[str]:
    """The parameters that can be given by name."""
    return [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_names(path: str, what: str, parameters: Mapping[str, inspect.Parameter], args: Mapping[str, Any],
                 args_key: str) -> None:
    """One line for an argument a factory that declares its names (no **kwargs) does not take."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    named = _named(parameters)
    for name in args:
        if name not in named:
            raise UserError(f"{what} factory '{path}' takes no argument '{name}' (from {args_key}.{name}): it takes "
                            f"{', '.join(named) or 'no arguments'}")
