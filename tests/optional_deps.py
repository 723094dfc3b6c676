"""Packages and programs some tests need that `./dev test` may not have: DJL's `djl_python`
(installed only where `../shared/vendor` holds its wheel), llama-cpp-python and vLLM (the CI
lanes' extras), Debian's `chromium` (the page's tests; `.ci/run` installs it where apt-get can).

Where one is missing, its tests skip and say why; where the run says it must be there
(`LMI_TESTS_REQUIRE=djl_python,vllm,chromium`, as `.ci/run` sets for what it installed), a
missing or broken one is an error, so a lane whose install went wrong fails instead of passing
empty.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def required() -> set[str]:
    return {name for name in os.environ.get("LMI_TESTS_REQUIRE", "").split(",") if name}


def need(module: str, reason: str) -> ModuleType:
    """`module`, imported; the calling test module skips (with `reason`) where it is missing,
    unless this run requires it."""
    if module in required():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def need_program(name: str, reason: str) -> str:
    """The path of program `name`; the calling test module skips (with `reason`) where it is not
    on PATH, unless this run requires it."""
    path = shutil.which(name)
    if path is not None:
        return path
    if name in required():
        raise RuntimeError(f"{name} is required by LMI_TESTS_REQUIRE but is not on PATH")
    pytest.skip(reason, allow_module_level=True)
