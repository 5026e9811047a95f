"""``manage.py explain_hold``: the story of a hold, and exit status 1 for no hold."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from reservations import services
from reservations.models import Offering
from tests.support.commands import run_from_argv


@pytest.mark.django_db
def test_explain_hold_of_no_hold_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_from_argv("explain_hold", "999999") == 1
    assert "verdict: no hold #999999" in capsys.readouterr().out


@pytest.mark.django_db
@pytest.mark.usefixtures("broker")
def test_explain_hold_command_prints_the_story(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "fay", ttl_seconds=60)
    out = StringIO()
    call_command("explain_hold", str(hold.pk), stdout=out)
    assert out.getvalue().splitlines()[0] == f"hold #{hold.pk}"
    assert out.getvalue().splitlines()[-1].startswith("verdict: held, not expired until ")
    with pytest.raises(SystemExit):
        call_command("explain_hold", "999999", stdout=StringIO())
