"""docs/UPGRADING.md keeps up with the code: every migration of both apps has its note (named
`app.migration`, as the doc writes them), and every environment variable start-up refuses as
retired is listed with where its value lives now."""

from __future__ import annotations

from cleanup.conf import RETIRED_VARIABLES
from config.settings import base
from tests.support import ROOT

UPGRADING = ROOT / "docs" / "UPGRADING.md"
APPS = ("reservations", "cleanup")


def upgrading() -> str:
    return UPGRADING.read_text(encoding="utf-8")


def migrations() -> list[str]:
    """``app.migration`` for every migration file of the two apps."""
    found = [
        f"{app}.{path.stem}"
        for app in APPS
        for path in sorted((ROOT / app / "migrations").glob("[0-9]*.py"))
    ]
    assert len(found) >= 2, "no migration files found"
    return found


def test_every_migration_has_a_note() -> None:
    text = upgrading()
    missing = [name for name in migrations() if f"`{name}`" not in text]
    assert missing == [], f"docs/UPGRADING.md says nothing about {missing}"


def test_every_retired_variable_is_listed() -> None:
    text = upgrading()
    retired = sorted({*RETIRED_VARIABLES, *base._RETIRED})
    missing = [name for name in retired if f"`{name}`" not in text]
    assert missing == [], f"docs/UPGRADING.md does not list the retired {missing}"
