"""The holder (a learner's identity) is never passed to a log call in cleanup/ or
reservations/."""

from __future__ import annotations

import re

import pytest

from tests.support import ROOT

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def test_the_holder_is_never_logged() -> None:
    """No log call in cleanup/ or reservations/ passes the holder (grep-level check)."""
    offenders = []
    for path in [*ROOT.glob("cleanup/**/*.py"), *ROOT.glob("reservations/**/*.py")]:
        text = path.read_text()
        for match in re.finditer(r"(logger|logging)\.\w+\((?:[^()]|\([^()]*\))*\)", text):
            if "holder" in match.group(0):
                offenders.append(f"{path}: {match.group(0)[:80]}")
    assert offenders == []
