"""The admin: an inspection tool over offerings, holds and the outbox, with one action."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from reservations import admin as reservations_admin
from reservations import services
from reservations.models import Offering, OutboxEvent, Reservation
from tests.support.holds import expire
from tests.support.staff import login_staff

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
