"""``python -c`` in a fresh interpreter: how a test sees what a process starting from nothing
sees (settings read at start-up, the transport the settings choose, a refusal at import)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

from tests.support import ROOT


def run_python(
    code: str, env: Mapping[str, str], *, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``code`` run from the checkout's root with exactly ``env``; its output as text. A child
    that hangs fails the test after a minute instead of holding the run."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )
