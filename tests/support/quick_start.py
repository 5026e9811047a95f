"""The Docker Compose quick start (docs/DEPLOY.md) as the tests see it: the ``.env`` that
``scripts/make_env.py`` renders from ``.env.example`` (read by the deploy checks and the
production-stack drill)."""

from __future__ import annotations

import importlib.util

from tests.support import ROOT


def quick_start_env() -> dict[str, str]:
    """The variables of the rendered ``.env`` (comments and blank lines left out)."""
    spec = importlib.util.spec_from_file_location("make_env", ROOT / "scripts" / "make_env.py")
    assert spec and spec.loader
    make_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_env)
    rendered = make_env.render((ROOT / ".env.example").read_text())
    return dict(
        line.split("=", 1) for line in rendered.splitlines() if "=" in line and line[0] != "#"
    )
