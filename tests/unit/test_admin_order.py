"""The admin is the same whatever the order of ``reservations`` and ``cleanup`` in
INSTALLED_APPS: the same admin class for every model, and a hold's page with the same fields
(the cleanup's sections through ``reservations.admin.add_reservation_section``, not a second
registration that only wins when its module is imported last).

Each order is loaded in a fresh interpreter (Django imports the admin modules once per
process). Break: ``ReservationAdmin.get_fields`` without the sections below the hold's own
fields: the hold's page loses "deliveries_counted" and "story" (checked: fails here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

DESCRIBE = """
import json, sys
import django
from django.conf import settings
apps = list(settings.INSTALLED_APPS)
first, second = sys.argv[1:3]
apps.remove(first); apps.remove(second)
settings.INSTALLED_APPS = [*apps, first, second]
django.setup()
from django.contrib import admin
from django.test import RequestFactory
from reservations.models import Reservation
request = RequestFactory().get("/")
hold = Reservation(pk=1, version=1)
hold_admin = admin.site._registry[Reservation]
print(json.dumps({
    "installed": [a for a in settings.INSTALLED_APPS if a in ("reservations", "cleanup")],
    "registry": sorted(
        f"{model._meta.label}: {type(model_admin).__module__}.{type(model_admin).__qualname__}"
        for model, model_admin in admin.site._registry.items()
    ),
    "hold_fields": [str(f) for f in hold_admin.get_fields(request, hold)],
    "hold_readonly": [str(f) for f in hold_admin.get_readonly_fields(request, hold)],
    "hold_labels": [
        admin.utils.label_for_field(f, Reservation, hold_admin)
        for f in hold_admin.get_fields(request, hold)
    ],
    "index_template": admin.site.index_template,
}))
"""


def _admin_with(first: str, second: str) -> dict[str, Any]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    out = subprocess.run(
        [sys.executable, "-c", DESCRIBE, first, second],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    described: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    assert described.pop("installed") == [first, second]
    return described


def test_the_admin_is_the_same_whatever_the_order_of_the_two_apps() -> None:
    domain_first = _admin_with("reservations", "cleanup")
    cleanup_first = _admin_with("cleanup", "reservations")
    assert domain_first == cleanup_first
    # and it is the whole admin: the domain's one ReservationAdmin, with the cleanup's sections
    registry = domain_first["registry"]
    assert "reservations.Reservation: reservations.admin.ReservationAdmin" in registry
    fields = domain_first["hold_fields"]
    assert fields[0] == "related" and fields[-2:] == ["deliveries_counted", "story"]
    assert {"related", "deliveries_counted", "story"} <= set(domain_first["hold_readonly"])
    assert "story (explain_hold)" in domain_first["hold_labels"]
