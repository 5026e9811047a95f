"""``manage.py create_offering``: an offering with every seat free, and ``--id-only``."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from reservations.models import Offering


@pytest.mark.django_db
def test_create_offering_creates_an_offering_with_every_seat_free() -> None:
    out = StringIO()
    call_command("create_offering", "--name", " Try-it workshop ", "--capacity", "2", stdout=out)
    offering = Offering.objects.get()
    assert (offering.name, offering.capacity, offering.seats_available) == ("Try-it workshop", 2, 2)
    assert (
        out.getvalue() == f"created offering {offering.pk} 'Try-it workshop': 2 seat(s), all free\n"
    )
    ids = StringIO()
    call_command("create_offering", "--name", "B", "--capacity", "0", "--id-only", stdout=ids)
    assert ids.getvalue() == f"{Offering.objects.get(name='B').pk}\n"
