"""The project's scripts (scripts/*.py, not a package) imported by the tests that use their
functions: the library suites' pin checks, the hashed installs of the tools' locks."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support import ROOT


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name``, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
