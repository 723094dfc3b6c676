"""A user's model.py, found and imported at startup as DJL Serving LMI finds it (djl_python 0.36:
service_loader.py, custom_formatter_handling.py, adapter_formatter_mixin.py).

Where: the model directory, and the model's own files where option.model_id names another
directory or an s3:// model (fetched first); a Hub model's only under option.trust_remote_code
(a Hub repository's .py files are its authors' code); and each LoRA adapter's folder
(`adapters/<name>/model.py`, overriding the base model's formatters for its requests). No
setting names it: a model.py found is imported once, with its folder on sys.path (as DJL's test
harness appends it), and scanned.

What: the functions DJL's decorators mark (`@input_formatter`, `@output_formatter`,
`@prediction_handler`, `@init_handler`); where none is marked, SageMaker inference toolkit's
`model_fn`, `input_fn`, `predict_fn`, `output_fn`, which take their places. Each is checked
against the call it will get, and the init handler (`model_fn`) runs once, here. Whatever
cannot work stops startup naming the file (and the line of an import that failed): two
functions for one place, a signature that does not fit, DJL's own `handle()` (a custom handler
runs inside DJL Serving), an adapter's model.py with more than formatters, or a model.py on a
server that serves embeddings only.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from handlers import djl as own_entry
from handlers.config import Config
from handlers.config.adapters import Adapter, with_model_adapters
from handlers.djl import decorators
from handlers.model_source import fetch_model, is_remote, local_path

log = logging.getLogger(__name__)

MODEL_PY = "model.py"


class ModelCodeError(RuntimeError):
    """A model.py that cannot be served; the message names the file."""


@dataclass(frozen=True)
class Role:
    """A place in DJL's flow a model.py function takes, and the call it gets there."""

    field: str
    decorator: str  # the attribute DJL's decorator sets
    sagemaker: str  # the inference toolkit's function for it
    said: str  # how errors name it
    args: tuple[Any, ...]  # a call it must accept (decorated; SageMaker's are positional)
    kwargs: dict[str, Any] = field(default_factory=dict)
    sagemaker_args: int = 2


ROLES = (
    Role("input_formatter", decorators.INPUT_FORMATTER, "input_fn", "input formatter",
         (None,), {"tokenizer": None}),
    Role("output_formatter", decorators.OUTPUT_FORMATTER, "output_fn", "output formatter",
         (None,)),
    Role("prediction_handler", decorators.PREDICTION_HANDLER, "predict_fn",
         "prediction handler", (None, None)),
    Role("init_handler", decorators.INIT_HANDLER, "model_fn", "init handler", (None,),
         sagemaker_args=1),
)


@dataclass(frozen=True)
class Function:
    call: Callable[..., Any]
    said: str  # e.g. "input formatter to_lmi (model.py)"


@dataclass(frozen=True)
class ModelCode:
    """What one model.py provides (DJL's CustomFormatterHandler)."""

    path: Path
    input_formatter: Function | None = None
    output_formatter: Function | None = None
    prediction_handler: Function | None = None
    init_handler: Function | None = None
    sagemaker: bool = False  # the inference toolkit's functions, called as it calls them


@dataclass(frozen=True)
class ModelCodes:
    """The base model's model.py (None: none) and the adapters' (by adapter name)."""

    base: ModelCode | None
    adapters: dict[str, ModelCode]
    model: Any = None  # what the init handler made (prediction handlers get it); None: none
    decorators: str = ""  # whose decorators the files imported

    @property
    def predicts(self) -> bool:
        """Whether requests are answered whole, through a prediction (`predict`): with a
        prediction handler, a model an init handler made, or SageMaker's functions beyond a
        lone input_fn. Otherwise generation streams as the request asks, through the
        formatters."""
        base = self.base
        if base is None:
            return False
        if base.prediction_handler is not None or self.model is not None:
            return True
        return base.sagemaker and (base.output_formatter is not None
                                   or base.init_handler is not None)


def find(config: Config) -> ModelCodes | None:
    """The model.py files `config` serves (None: none), as `load` leaves them."""
    folders = _model_folders(config)
    adapters = {a.name: a.path for a in _adapters(config, folders)}
    if config.embeddings_only:
        for path in (folder / MODEL_PY for folder in [*folders, *adapters.values()]):
            if path.is_file():
                raise ModelCodeError(f"{path}: a model.py shapes text generation's requests and "
                                     "answers, and option.task=text-embedding serves no LLM")
    return load(folders, adapters)


def load(folders: list[Path], adapters: dict[str, Path]) -> ModelCodes | None:
    """The model.py of the base model (in one of `folders`) and of each adapter (by name, its
    folder): imported, checked, and the init handler run; None where there is none;
    ModelCodeError for one that cannot be served."""
    paths = [folder / MODEL_PY for folder in [*folders, *adapters.values()]]
    if not any(path.is_file() for path in paths):
        return None
    whose = decorators.provide()
    base = _base(folders)
    codes = {name: code for name, folder in adapters.items()
             if (code := read(folder, f"adapter_{name}", f"LoRA adapter {name!r}"))}
    if base is None and not codes:
        return None
    for name, code in codes.items():
        _check_adapter_code(name, code)
    model = _run_init(base)
    if model is not None and base.prediction_handler is None and \
            not callable(getattr(model, "predict", None)):
        raise ModelCodeError(f"{base.path}: the {base.init_handler.said} made a "
                             f"{type(model).__name__}, which has no predict(): add a prediction "
                             "handler that uses it")
    found = ModelCodes(base, codes, model, whose)
    log.info("model.py: %s; decorators from %s", _described(found), whose)
    return found


def _model_folders(config: Config) -> list[Path]:
    """Where the base model's model.py may be: the model directory, then the model's own."""
    folders = [config.model_dir]
    model_id = config.model_id
    if model_id is None:
        return folders
    if is_remote(model_id, config.model_dir):
        if model_id.startswith("s3://") or config.trust_remote_code:
            folders.append(fetch_model(model_id, config.revision))  # the model's load reuses it
        return folders
    own = local_path(model_id, config.model_dir)
    if own.is_dir() and own.resolve() != config.model_dir.resolve():
        folders.append(own)
    return folders


def _adapters(config: Config, folders: list[Path]) -> tuple[Adapter, ...]:
    """The adapters served: those configured, and those in the model's own adapters/."""
    adapters = config.adapters
    for folder in folders[1:]:
        adapters = with_model_adapters(adapters, config.model_dir, folder, config.model_name)
    return adapters


def _base(folders: list[Path]) -> ModelCode | None:
    found = [folder for folder in folders if (folder / MODEL_PY).is_file()]
    if len(found) > 1:
        raise ModelCodeError(f"two model.py files, {found[0] / MODEL_PY} and "
                             f"{found[1] / MODEL_PY}: keep one")
    return read(found[0], "model", "the model") if found else None


def read(folder: Path, namespace: str, whose: str) -> ModelCode | None:
    """`folder`'s model.py (`whose`: the model, or an adapter), imported and scanned (None: it
    defines none of DJL's functions)."""
    path = folder / MODEL_PY
    if not path.is_file():
        return None
    module = _import(path, "lmi_serve_model_py_" + re.sub(r"\W", "_", namespace))
    _check_handle(module, path)
    where = f"model.py of {whose}"
    decorated = {role.field: _decorated(module, role, path, where) for role in ROLES}
    if any(decorated.values()):
        return ModelCode(path, **decorated)
    toolkit = {role.field: _toolkit(module, role, path, where) for role in ROLES}
    if any(toolkit.values()):
        return ModelCode(path, **toolkit, sagemaker=True)
    log.info("%s defines none of DJL's formatters or handlers, nor SageMaker's functions: "
             "requests are answered as they are", path)
    return None


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:  # its own helper modules import from beside it
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise ModelCodeError(f"importing {path}{_line(exc, path)} failed: "
                             f"{type(exc).__name__}: {exc}{_hint(exc)}") from exc
    return module


def _line(exc: BaseException, path: Path) -> str:
    """`, line N`: where in `path` the import failed (a syntax error's own line)."""
    if isinstance(exc, SyntaxError) and exc.filename == str(path):
        return f", line {exc.lineno}"
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__)
             if frame.filename == str(path)]
    return f", line {lines[-1]}" if lines else ""


def _hint(exc: BaseException) -> str:
    standing_in = getattr(sys.modules.get("djl_python"), decorators.STAND_IN, False)
    if standing_in and isinstance(exc, ImportError) and \
            (exc.name or "").startswith("djl_python"):
        return (" (djl_python is not installed: only DJL's decorators can be imported, "
                "input_formatter, prediction_handler and init_handler from "
                "djl_python.input_parser, output_formatter from djl_python.output_formatter)")
    return ""


def _check_handle(module: ModuleType, path: Path) -> None:
    """DJL runs a model.py's `handle()` instead of its own handlers: a custom handler, which
    runs inside DJL Serving. This project's own DJL entry is served as it is."""
    handle = getattr(module, "handle", None)
    if callable(handle) and handle is not own_entry.handle:
        raise ModelCodeError(f"{path} defines handle(): DJL Serving's custom handler, which "
                             "runs inside DJL Serving; lmi-serve applies a model.py's "
                             "formatters and handlers (DJL's decorators, SageMaker's functions)")


def _decorated(module: ModuleType, role: Role, path: Path, where: str) -> Function | None:
    """The function DJL's decorator marked for `role` (DJL takes the first by name; two are
    refused here)."""
    marked = [name for name in sorted(dir(module))
              if callable(getattr(module, name)) and getattr(getattr(module, name),
                                                             role.decorator, False)]
    if len(marked) > 1:
        raise ModelCodeError(f"{path} marks {len(marked)} functions @{role.field}: "
                             f"{', '.join(marked)}; keep one")
    if not marked:
        return None
    function = Function(getattr(module, marked[0]), f"{role.said} {marked[0]} ({where})")
    _check_call(function, role.args, role.kwargs, path,
                f"({', '.join(['x'] * len(role.args) + [f'{k}=...' for k in role.kwargs])})")
    return function


def _toolkit(module: ModuleType, role: Role, path: Path, where: str) -> Function | None:
    call = getattr(module, role.sagemaker, None)
    if not callable(call):
        return None
    function = Function(call, f"{role.sagemaker} ({where})")
    _check_call(function, (None,) * role.sagemaker_args, {}, path,
                f"with {role.sagemaker_args} positional argument(s)")
    return function


def _check_call(function: Function, args: tuple[Any, ...], kwargs: dict[str, Any], path: Path,
                shape: str) -> None:
    try:
        inspect.signature(function.call).bind(*args, **kwargs)
    except TypeError as exc:
        raise ModelCodeError(f"{path}: the {function.said} is called {shape}, which its "
                             f"signature does not take: {exc}") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass


def _check_adapter_code(name: str, code: ModelCode) -> None:
    """An adapter's model.py overrides the base model's formatters (DJL applies nothing else
    of it): anything else in it could never take effect."""
    extra = [function.said for function in (code.prediction_handler, code.init_handler)
             if function is not None]
    if code.sagemaker:
        extra = ["SageMaker's functions"]
    if extra:
        raise ModelCodeError(f"{code.path} (LoRA adapter {name!r}) holds {', '.join(extra)}: "
                             "an adapter's model.py holds @input_formatter and "
                             "@output_formatter only; handlers belong to the base model's")


def _run_init(base: ModelCode | None) -> Any:
    """The init handler's model (`model_fn(model_dir)`), made once, now."""
    if base is None or base.init_handler is None:
        return None
    try:
        return base.init_handler.call(str(base.path.parent))
    except Exception as exc:
        raise ModelCodeError(f"{base.path}: the {base.init_handler.said} failed: "
                             f"{type(exc).__name__}: {exc}") from exc


def _described(found: ModelCodes) -> str:
    parts = []
    for code in (found.base, *found.adapters.values()):
        if code is None:
            continue
        functions = [getattr(code, role.field) for role in ROLES]
        parts.append(f"{code.path}: " + ", ".join(f.said for f in functions if f))
    return "; ".join(parts)


def without(found: ModelCodes, adapter: str) -> ModelCodes:
    """`found` less `adapter`'s model.py (the adapter was unregistered)."""
    return replace(found, adapters={k: v for k, v in found.adapters.items() if k != adapter})
