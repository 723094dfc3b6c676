"""DJL's decorators for a model.py, under djl_python's names where DJL's own package is missing.

A model.py written for DJL LMI imports `input_formatter`, `prediction_handler` and
`init_handler` from `djl_python.input_parser` and `output_formatter` from
`djl_python.output_formatter`. `djl_python` ships only in DJL's containers (the image and
`./dev serve` have none), so `provide()` registers these four, which mark a function exactly as
DJL's do, as `djl_python`, `djl_python.input_parser` and `djl_python.output_formatter`.

It cannot shadow DJL's package: it registers them only where `importlib.util.find_spec` finds no
`djl_python` (none on sys.path, or its import blocked by a None in sys.modules) and none was
imported; a djl_python that can be imported is imported instead, and its decorators mark the
functions. The stand-in is registered once, before any model.py is imported, and holds nothing
else: any other djl_python import of a model.py fails, naming the module.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# The attribute each decorator sets, as DJL's service_loader finds them.
INPUT_FORMATTER = "is_input_formatter"
OUTPUT_FORMATTER = "is_output_formatter"
PREDICTION_HANDLER = "is_prediction_handler"
INIT_HANDLER = "is_init_handler"
STAND_IN = "__lmi_serve_stand_in__"  # marks the stand-in's modules


def _marking(attribute: str) -> Callable[[F], F]:
    def decorator(function: F) -> F:
        setattr(function, attribute, True)
        return function

    decorator.__name__ = attribute.removeprefix("is_")
    return decorator


input_formatter = _marking(INPUT_FORMATTER)
output_formatter = _marking(OUTPUT_FORMATTER)
prediction_handler = _marking(PREDICTION_HANDLER)
init_handler = _marking(INIT_HANDLER)

_MODULES = {
    "djl_python.input_parser": {"input_formatter": input_formatter,
                                "prediction_handler": prediction_handler,
                                "init_handler": init_handler},
    "djl_python.output_formatter": {"output_formatter": output_formatter},
}


def provide() -> str:
    """Make DJL's decorators importable; say whose: DJL's djl_python, or this stand-in."""
    if sys.modules.get("djl_python") is not None:
        return _whose(sys.modules["djl_python"])
    if importlib.util.find_spec("djl_python") is not None:
        return _whose(importlib.import_module("djl_python"))
    package = _module("djl_python", {}, package=True)
    for name, functions in _MODULES.items():
        module = _module(name, functions)
        sys.modules[name] = module
        setattr(package, name.rpartition(".")[2], module)
    sys.modules["djl_python"] = package
    return _whose(package)


def _whose(package: ModuleType) -> str:
    if getattr(package, STAND_IN, False):
        return "lmi-serve's stand-in for djl_python (its decorators only)"
    return f"DJL's djl_python {getattr(package, '__version__', '')}".rstrip()


def _module(name: str, functions: dict[str, Callable], package: bool = False) -> ModuleType:
    module = ModuleType(name, "lmi-serve's stand-in for DJL's module of the same name: its "
                        "decorators for a model.py, as djl_python is not installed")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    setattr(module, STAND_IN, True)
    module.__dict__.update(functions)
    return module
