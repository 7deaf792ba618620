"""`package.module:function` factories for users' own data sets and models.

A factory runs the user's code by design: only point hvdtrain at code you trust.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from hvdtrain.errors import UserError


def is_factory_path(text: str) -> bool:
    module, sep, function = text.partition(":")
    return bool(sep and module and function)


def resolve_factory(path: str, what: str, require_callable: bool = True) -> Callable[..., Any]:
    """Imports `package.module:function`; a clear error when it does not import."""
    if not is_factory_path(path):
        raise UserError(f"{what} factory '{path}' must look like package.module:function")
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
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
            raise UserError(f"{what} factory '{path}': '{module_name}' has no attribute '{attribute}'")
        target = getattr(target, part)
    if require_callable and not callable(target):
        raise UserError(f"{what} factory '{path}' is not callable")
    return target


def call_factory(path: str, what: str, offered: dict[str, Any], unknown: dict[str, str] | None = None) -> Any:
    """Imports and calls a factory with those of the offered keyword arguments it accepts.

    An offered value of None is not passed (the factory's default applies); when the
    factory requires it, the error says why it is unknown: `unknown[name]`.
    """
    factory = resolve_factory(path, what)
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name, why in (unknown or {}).items():
        parameter = parameters.get(name)
        if offered.get(name) is None and parameter is not None and parameter.default is inspect.Parameter.empty:
            raise UserError(f"{what} factory '{path}' takes {name}, but {why}")
    kwargs = {k: v for k, v in offered.items() if v is not None and (takes_any or k in parameters)}
    try:
        return factory(**kwargs)
    except Exception as err:
        raise UserError(f"{what} factory '{path}' raised {type(err).__name__}: {err} "
                        "(--debug shows the traceback)") from err
