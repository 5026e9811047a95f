"""The domain's admin (reservations.admin): an inspection tool over offerings, holds and the
outbox, with one action (release now, behind a confirmation, audited); API clients, whose
token is shown once; and the same admin whatever the order of the two apps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from reservations import admin as reservations_admin
from reservations import services
from reservations.models import ApiClient, ApiToken, Offering, OutboxEvent, Reservation
from tests.support import ROOT
from tests.support.holds import expire, expired_holds
from tests.support.staff import login_staff, messages_of

CHANGELIST = "admin:reservations_reservation_changelist"
OFFERINGS = "admin:reservations_offering_changelist"
OUTBOX = "admin:reservations_outboxevent_changelist"


def expired_hold(
    offering: Offering, holder: str, ago: timedelta = timedelta(minutes=5)
) -> Reservation:
    hold = services.hold_seat(offering.pk, holder, ttl_seconds=1)
    expire(hold, ago=ago)
    return hold


@pytest.fixture
def staff_client(db: None) -> Client:
    return login_staff(
        "ops",
        "view_offering",
        "change_offering",
        "add_offering",
        "view_reservation",
        "change_reservation",
        "view_outboxevent",
        app_label="reservations",
    )


@pytest.fixture
def viewer_client(db: None) -> Client:
    return login_staff(
        "viewer", "view_offering", "view_reservation", "view_outboxevent", app_label="reservations"
    )


def listed_ids(response: Any) -> set[int]:
    return {obj.pk for obj in response.context["cl"].result_list}


def run_action(client: Client, holds: list[Reservation]) -> tuple[Any, list[str]]:
    response = client.post(
        reverse(CHANGELIST),
        {
            "action": "release_expired_now",
            "_selected_action": [h.pk for h in holds],
            "index": 0,
            "confirm": "yes",
        },
        follow=True,
    )
    return response, [str(m) for m in get_messages(response.wsgi_request)]


# --- pages --------------------------------------------------------------------------------


def test_the_hold_list_renders_with_an_expired_for_column(staff_client, offering):
    # given
    live = services.hold_seat(offering.pk, "live-learner")
    stale = expired_hold(offering, "stale-learner", ago=timedelta(hours=2, minutes=3))
    # when
    response = staff_client.get(reverse(CHANGELIST))
    # then
    assert response.status_code == 200
    assert listed_ids(response) == {live.pk, stale.pk}
    rows = {obj.pk: obj for obj in response.context["cl"].result_list}
    model_admin = response.context["cl"].model_admin
    assert model_admin.expired_for(rows[stale.pk]) == "2h 3m"
    assert model_admin.expired_for(rows[live.pk]) == "—"
    assert b"2h 3m" in response.content
    assert b"Release expired holds now" in response.content


def test_the_hold_list_queries_do_not_grow_with_the_rows(
    staff_client, make_offering, django_assert_max_num_queries
):
    # given: holds on several offerings (list_select_related joins the offering)
    for i in range(6):
        services.hold_seat(make_offering(name=f"section {i}").pk, f"learner-{i}")
    # then: session, user, permissions, count, rows, filters, ...: a constant, not 6+
    with django_assert_max_num_queries(12):
        assert staff_client.get(reverse(CHANGELIST)).status_code == 200


def test_the_hold_page_renders_read_only_with_its_outbox_events(staff_client, offering):
    # given
    hold = services.hold_seat(offering.pk, "learner-1")
    hold = services.renew(hold.pk, 1)
    # when
    response = staff_client.get(reverse("admin:reservations_reservation_change", args=[hold.pk]))
    # then
    assert response.status_code == 200
    content = response.content.decode()
    assert "reservation.held" in content
    assert "reservation.renewed" in content
    assert 'name="_save"' not in content  # nothing to save: state changes only via services
    assert "outbox_events-TOTAL_FORMS" in content


def test_a_hold_cannot_be_added_changed_or_deleted_in_the_admin(staff_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    change_url = reverse("admin:reservations_reservation_change", args=[hold.pk])
    # when: someone posts a change anyway
    response = staff_client.post(change_url, {"status": "confirmed", "holder": "x"})
    # then
    assert response.status_code == 403
    assert staff_client.get(reverse("admin:reservations_reservation_add")).status_code == 403
    delete_url = reverse("admin:reservations_reservation_delete", args=[hold.pk])
    assert staff_client.post(delete_url, {"post": "yes"}).status_code == 403
    hold.refresh_from_db()
    assert (hold.status, hold.holder) == ("held", "learner-1")


def test_the_offering_list_shows_held_and_eligible_counts(staff_client, make_offering):
    # given
    busy = make_offering(capacity=5, name="busy")
    services.hold_seat(busy.pk, "a")
    services.hold_seat(busy.pk, "b")
    expired_hold(busy, "c")
    quiet = make_offering(capacity=2, name="quiet")
    # when
    response = staff_client.get(reverse(OFFERINGS))
    # then
    assert response.status_code == 200
    rows = {o.pk: o for o in response.context["cl"].result_list}
    assert (rows[busy.pk].held_count, rows[busy.pk].eligible_count) == (3, 1)
    assert (rows[quiet.pk].held_count, rows[quiet.pk].eligible_count) == (0, 0)
    assert rows[busy.pk].seats_available == 2


def test_the_offering_list_queries_do_not_grow_with_the_rows(
    staff_client, make_offering, django_assert_max_num_queries
):
    for i in range(8):
        services.hold_seat(make_offering(name=f"section {i}").pk, "learner")
    with django_assert_max_num_queries(8):
        assert staff_client.get(reverse(OFFERINGS)).status_code == 200


def test_renaming_an_offering_does_not_write_back_its_seat_count(staff_client, offering):
    # given: the admin form was loaded, then a learner took a seat
    url = reverse("admin:reservations_offering_change", args=[offering.pk])
    assert staff_client.get(url).status_code == 200
    services.hold_seat(offering.pk, "learner-1")
    # when
    response = staff_client.post(url, {"name": "Renamed"})
    # then
    assert response.status_code == 302
    offering.refresh_from_db()
    assert offering.name == "Renamed"
    assert offering.seats_available == offering.capacity - 1
    assert services.seat_conservation_violations() == []


def test_adding_an_offering_in_the_admin_starts_with_every_seat_free(staff_client, db):
    response = staff_client.post(
        reverse("admin:reservations_offering_add"), {"name": "New section", "capacity": 7}
    )
    assert response.status_code == 302
    created = Offering.objects.get(name="New section")
    assert (created.capacity, created.seats_available) == (7, 7)


def test_the_outbox_list_renders_and_filters_by_published(staff_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    services.confirm(hold.pk, 1)
    OutboxEvent.objects.filter(kind="reservation.held").update(published_at=Now())
    response = staff_client.get(reverse(OUTBOX), {"published": "no"})
    assert response.status_code == 200
    assert {e.kind for e in response.context["cl"].result_list} == {"reservation.confirmed"}
    response = staff_client.get(reverse(OUTBOX), {"kind__exact": "reservation.held"})
    assert {e.kind for e in response.context["cl"].result_list} == {"reservation.held"}


# --- filter and search --------------------------------------------------------------------


def test_the_expired_but_still_held_filter_shows_exactly_the_eligible_holds(
    staff_client, make_offering
):
    # given: one of each situation
    offering = make_offering(capacity=10)
    live = services.hold_seat(offering.pk, "live")
    stale_a = expired_hold(offering, "stale-a")
    stale_b = expired_hold(offering, "stale-b", ago=timedelta(days=2))
    confirmed = services.hold_seat(offering.pk, "confirmed")
    services.confirm(confirmed.pk, 1)
    cancelled_after_expiry = expired_hold(offering, "cancelled")
    services.cancel(cancelled_after_expiry.pk, 1)
    released = expired_hold(offering, "released")
    services.release_if_expired(released.pk, 1)
    # when
    yes = staff_client.get(reverse(CHANGELIST), {"expired_held": "yes"})
    no = staff_client.get(reverse(CHANGELIST), {"expired_held": "no"})
    # then
    eligible = set(Reservation.objects.eligible().values_list("pk", flat=True))
    assert eligible == {stale_a.pk, stale_b.pk}
    assert listed_ids(yes) == eligible
    assert listed_ids(no) == {live.pk, confirmed.pk, cancelled_after_expiry.pk, released.pk}


def test_searching_a_number_finds_the_hold_with_that_id(staff_client, make_offering):
    offering = make_offering(capacity=5)
    holds = [services.hold_seat(offering.pk, f"learner-{i}") for i in range(3)]
    target = holds[1]
    response = staff_client.get(reverse(CHANGELIST), {"q": str(target.pk)})
    assert response.status_code == 200
    assert target.pk in listed_ids(response)
    assert all(
        obj.pk == target.pk or str(target.pk) in obj.holder
        for obj in response.context["cl"].result_list
    )


def test_searching_text_finds_holds_by_holder(staff_client, make_offering):
    offering = make_offering(capacity=5)
    alice = services.hold_seat(offering.pk, "alice@example.org")
    services.hold_seat(offering.pk, "bob@example.org")
    response = staff_client.get(reverse(CHANGELIST), {"q": "ALICE"})
    assert listed_ids(response) == {alice.pk}
    huge = staff_client.get(reverse(CHANGELIST), {"q": "9" * 40})
    assert huge.status_code == 200
    assert listed_ids(huge) == set()


# --- the release action -------------------------------------------------------------------


def test_the_release_action_releases_eligible_holds_and_reports_counts(staff_client, make_offering):
    # given
    offering = make_offering(capacity=10)
    stale = [expired_hold(offering, f"stale-{i}") for i in range(3)]
    live = services.hold_seat(offering.pk, "live")
    confirmed = services.hold_seat(offering.pk, "confirmed")
    services.confirm(confirmed.pk, 1)
    # when
    response, messages = run_action(staff_client, [*stale, live, confirmed])
    # then
    assert response.status_code == 200
    assert messages == ["released: 3, no_longer_held: 1, not_expired: 1"]
    for hold in stale:
        hold.refresh_from_db()
        assert (hold.status, hold.release_reason, hold.released_version) == ("released", "admin", 1)
    live.refresh_from_db()
    assert live.status == "held"
    assert OutboxEvent.objects.filter(kind="reservation.released").count() == 3
    offering.refresh_from_db()
    assert offering.seats_available == 10 - 2  # live + confirmed keep their seats
    assert services.seat_conservation_violations() == []


def test_running_the_release_action_twice_releases_nothing_more(staff_client, offering):
    stale = expired_hold(offering, "stale")
    run_action(staff_client, [stale])
    _, messages = run_action(staff_client, [stale])
    assert messages == ["already_handled: 1"]
    assert OutboxEvent.objects.filter(kind="reservation.released").count() == 1


def test_a_failing_row_is_reported_and_the_others_are_still_released(
    staff_client, make_offering, monkeypatch
):
    # given: one hold keeps racing a concurrent change
    offering = make_offering(capacity=5)
    ok = expired_hold(offering, "ok")
    racy = expired_hold(offering, "racy")
    real = services.release_if_expired

    def flaky(reservation_id: int, version: int, **kwargs: Any) -> services.ReleaseOutcome:
        if reservation_id == racy.pk:
            raise services.TransientConflict("changed during release")
        return real(reservation_id, version, **kwargs)

    monkeypatch.setattr(services, "release_if_expired", flaky)
    # when
    response, messages = run_action(staff_client, [ok, racy])
    # then
    assert response.status_code == 200
    assert messages[0] == "released: 1, error: 1"
    assert f"#{racy.pk}: busy" in messages[1]
    ok.refresh_from_db()
    racy.refresh_from_db()
    assert (ok.status, racy.status) == ("released", "held")


def test_the_release_action_refuses_an_oversized_selection(
    staff_client, make_offering, monkeypatch
):
    monkeypatch.setattr(reservations_admin, "ADMIN_RELEASE_LIMIT", 2)
    offering = make_offering(capacity=5)
    stale = [expired_hold(offering, f"stale-{i}") for i in range(3)]
    _, messages = run_action(staff_client, stale)
    assert "at most 2" in messages[0]
    assert Reservation.objects.eligible().count() == 3


def test_the_release_action_takes_a_selection_of_exactly_its_limit(
    staff_client, make_offering, monkeypatch
):
    # given: a release limit of two, and two stale holds selected by hand
    monkeypatch.setattr(reservations_admin, "ADMIN_RELEASE_LIMIT", 2)
    offering = make_offering(capacity=5)
    stale = [expired_hold(offering, f"stale-{i}") for i in range(2)]
    # when: the action runs on them
    _, messages = run_action(staff_client, stale)
    # then: a selection at the limit is not refused as oversized: both are released
    assert messages == ["released: 2"]
    assert Reservation.objects.eligible().count() == 0


def test_a_view_only_user_sees_no_release_action_and_cannot_run_it(viewer_client, offering):
    stale = expired_hold(offering, "stale")
    page = viewer_client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    assert b"Release expired holds now" not in page.content
    run_action(viewer_client, [stale])
    stale.refresh_from_db()
    assert stale.status == "held"


# --- access -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url_name",
    [CHANGELIST, OFFERINGS, OUTBOX, "admin:reservations_reservation_change"],
)
def test_anonymous_users_are_redirected_to_login(client, offering, url_name):
    hold = services.hold_seat(offering.pk, "learner-1")
    args = [hold.pk] if url_name.endswith("_change") else []
    response = client.get(reverse(url_name, args=args))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_anonymous_users_cannot_run_the_release_action(client, offering):
    stale = expired_hold(offering, "stale")
    response = client.post(
        reverse(CHANGELIST),
        {"action": "release_expired_now", "_selected_action": [stale.pk], "index": 0},
    )
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))
    stale.refresh_from_db()
    assert stale.status == "held"


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(seconds=0), "0s"),
        (timedelta(seconds=42), "42s"),
        (timedelta(minutes=5), "5m 0s"),
        (timedelta(hours=2, minutes=3, seconds=4), "2h 3m"),
        (timedelta(days=3, hours=1), "3d 1h"),
        (timedelta(seconds=-5), "0s"),
    ],
)
def test_durations_read_as_their_two_largest_units(delta, text):
    assert reservations_admin.human_duration(delta) == text


# --- API clients: a token is shown once, stored as a digest, and revocable ------------------

TOKEN = re.compile(r"rsv_[A-Za-z0-9_-]{43}")


def issue(admin_client: Client, client: ApiClient) -> list[str]:
    """The tokens the page shows after the issue action."""
    page = admin_client.post(
        "/admin/reservations/apiclient/",
        {"action": "issue_token", "_selected_action": [client.pk]},
        follow=True,
    )
    return TOKEN.findall(page.content.decode())


def availability(client: Client, offering_id: int, token: str) -> int:
    response = client.get(
        f"/api/v1/offerings/{offering_id}/availability",
        headers={"Authorization": f"Bearer {token}"},
    )
    return int(response.status_code)


def test_adding_a_client_shows_its_token_once_and_the_token_works(admin_client, offering):
    # when a staff member adds a client
    response = admin_client.post(
        "/admin/reservations/apiclient/add/",
        {
            "name": "checkout",
            "is_active": "on",
            "can_read": "on",
            "can_write": "on",
            "offerings": [offering.pk],
            "requests_per_minute": "100",
            "tokens-TOTAL_FORMS": "0",
            "tokens-INITIAL_FORMS": "0",
        },
        follow=True,
    )
    # then the token is on the page once, works, and the database has only its digest
    assert response.status_code == 200
    (token,) = TOKEN.findall(response.content.decode())
    client = ApiClient.objects.get(name="checkout")
    assert list(client.offerings.all()) == [offering]
    stored = ApiToken.objects.get(client=client)
    assert token.startswith(stored.prefix) and token != stored.digest
    assert availability(Client(), offering.pk, token) == 200
    # and the client's page does not show it again
    page = admin_client.get(f"/admin/reservations/apiclient/{client.pk}/change/")
    assert TOKEN.findall(page.content.decode()) == []
    assert stored.prefix in page.content.decode()


def test_issuing_a_second_token_and_revoking_the_first(admin_client, offering):
    client = ApiClient.objects.create(name="checkout", all_offerings=True)
    (first,) = issue(admin_client, client)
    (second,) = issue(admin_client, client)
    first_row = ApiToken.objects.get(prefix=first[:12])
    # the revoke action asks first, then revokes only what it showed
    asked = admin_client.post(
        "/admin/reservations/apitoken/",
        {"action": "revoke", "_selected_action": [first_row.pk]},
    )
    assert asked.status_code == 200 and b"Revoke API tokens?" in asked.content
    assert availability(Client(), offering.pk, first) == 200
    admin_client.post(
        "/admin/reservations/apitoken/",
        {
            "action": "revoke",
            "_selected_action": [first_row.pk],
            "confirm": "yes",
            "confirm_ids": str(first_row.pk),
        },
    )
    assert availability(Client(), offering.pk, first) == 401
    assert availability(Client(), offering.pk, second) == 200
    first_row.refresh_from_db()
    assert first_row.revoked_at is not None
    assert LogEntry.objects.filter(
        object_id=str(first_row.pk), change_message="revoke API token: revoked"
    ).exists()


def test_a_client_cannot_be_deleted_only_deactivated(admin_client, db):
    client = ApiClient.objects.create(name="checkout")
    response = admin_client.post(
        f"/admin/reservations/apiclient/{client.pk}/delete/", {"post": "yes"}
    )
    assert response.status_code == 403
    assert ApiClient.objects.filter(pk=client.pk).exists()


# --- the same admin whatever the order of ``reservations`` and ``cleanup`` in INSTALLED_APPS --
#
# The same admin class for every model, and a hold's page with the same fields (the cleanup's
# sections through ``reservations.admin.add_reservation_section``, not a second registration
# that only wins when its module is imported last). Each order is loaded in a fresh interpreter
# (Django imports the admin modules once per process). Break: ``ReservationAdmin.get_fields``
# without the sections below the hold's own fields: the hold's page loses "deliveries_counted"
# and "story" (checked: fails here).

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


# --- release now, as a superuser: asks first, then releases and audits --------------------


def test_release_now_asks_first_then_releases_and_audits(root_client, offering):
    stale = expired_holds(2, offering_id=offering.pk, ago=timedelta(seconds=300))
    live = services.hold_seat(offering.pk, "live", ttl_seconds=600)
    ids = [*stale, live.pk]
    page = root_client.post(
        reverse(CHANGELIST), {"action": "release_expired_now", "_selected_action": ids, "index": 0}
    )
    html = page.content.decode()
    assert "Release 3 reservations?" in html
    assert re.search(r"expired and still held: will be released</td><td[^>]*>2<", html)
    assert Reservation.objects.filter(status="held").count() == 3
    done = root_client.post(
        reverse(CHANGELIST),
        {"action": "release_expired_now", "_selected_action": ids, "index": 0, "confirm": "yes"},
        follow=True,
    )
    assert "released: 2, not_expired: 1" in messages_of(done)
    messages = {int(e.object_id): e.get_change_message() for e in LogEntry.objects.all()}
    assert messages == {
        stale[0]: "release expired holds now: released",
        stale[1]: "release expired holds now: released",
        live.pk: "release expired holds now: not_expired",
    }
