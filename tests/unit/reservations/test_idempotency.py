"""Idempotency-Key through the JSON API against a real PostgreSQL (reservations.idempotency): a
retried request replays its first answer and takes one seat, keys belong to their client, a key
reused for another request is refused, and expired keys are pruned."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from cleanup.tasks import prune_task
from reservations import idempotency, services
from reservations.models import IdempotencyKey, Reservation
from tests.support.api import API_TOKEN, call, error_code, hold_url, seats_left
from tests.support.holds import expire

pytestmark = pytest.mark.usefixtures("api_token")


def test_a_retried_hold_under_the_same_key_replays_the_response_and_takes_one_seat(
    client, offering, make_client
):
    # given a checkout that timed out after its first attempt
    _, token = make_client()
    body = {"holder": "ann", "ttl_seconds": 120}
    first = call(client, "post", hold_url(offering), token, body, key="order-1001")
    # when it retries with the same key and request
    retry = call(client, "post", hold_url(offering), token, body, key="order-1001")
    # then it gets the same answer, and the learner holds one seat
    assert first.status_code == retry.status_code == 201
    assert retry.json() == first.json()
    assert retry["Location"] == first["Location"]
    assert first["Idempotent-Replayed"] == "false"
    assert retry["Idempotent-Replayed"] == "true"
    assert Reservation.objects.filter(offering=offering).count() == 1
    assert seats_left(offering) == offering.capacity - 1


def test_the_same_request_spelled_differently_is_still_the_same_request(
    client, offering, make_client
):
    _, token = make_client()
    first = call(
        client, "post", hold_url(offering), token, {"holder": "ann", "ttl_seconds": 60}, key="k"
    )
    again = call(
        client,
        "post",
        hold_url(offering),
        token,
        raw='{ "ttl_seconds" : 60,\n "holder": "ann" }',
        key="k",
    )
    assert again.status_code == 201
    assert again.json()["id"] == first.json()["id"]


def test_a_key_reused_for_a_different_request_is_refused_and_changes_nothing(
    client, offering, make_offering, make_client
):
    # given
    _, token = make_client()
    call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="order-1")
    other = make_offering(name="other")
    # when: another body, then another path, under the same key
    other_body = call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="order-1")
    other_path = call(client, "post", hold_url(other), token, {"holder": "ann"}, key="order-1")
    # then
    for response in (other_body, other_path):
        assert response.status_code == 422, response.content
        problem = response.json()
        assert (problem["code"], problem["field"]) == ("idempotency_key_reused", "Idempotency-Key")
        assert problem["detail"]
    assert Reservation.objects.count() == 1
    assert seats_left(other) == other.capacity


def test_keys_belong_to_their_client(client, offering, make_client):
    _, first_token = make_client("first")
    _, second_token = make_client("second")
    a = call(client, "post", hold_url(offering), first_token, {"holder": "ann"}, key="shared-key")
    b = call(client, "post", hold_url(offering), second_token, {"holder": "ann"}, key="shared-key")
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert b["Idempotent-Replayed"] == "false"


def test_the_development_tokens_keys_are_one_scope_of_their_own(client, offering, make_client):
    # the development token has no client row: its keys still meet each other, not a client's
    body = {"holder": "ann"}
    first = call(client, "post", hold_url(offering), API_TOKEN, body, key="dev-1")
    retry = call(client, "post", hold_url(offering), API_TOKEN, body, key="dev-1")
    _, token = make_client()
    other = call(client, "post", hold_url(offering), token, body, key="dev-1")
    assert retry.json() == first.json()
    assert retry["Idempotent-Replayed"] == "true"
    assert other["Idempotent-Replayed"] == "false"
    assert Reservation.objects.count() == 2


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_a_retried_change_of_a_hold_replays_its_first_answer(client, offering, make_client, action):
    # given a hold at version 1, changed once under a key
    _, token = make_client()
    hold = call(client, "post", hold_url(offering), token, {"holder": "ann"}).json()
    url = f"/api/v1/holds/{hold['id']}/{action}"
    first = call(client, "post", url, token, {"expected_version": 1}, key=f"{action}-1")
    # when the client retries: without the key this is a 409 (the version moved on)
    retry = call(client, "post", url, token, {"expected_version": 1}, key=f"{action}-1")
    bare = call(client, "post", url, token, {"expected_version": 1})
    # then
    assert first.status_code == retry.status_code == 200
    assert retry.json() == first.json()
    assert bare.status_code == 409
    assert Reservation.objects.get(pk=hold["id"]).version == 2
    assert services.seat_conservation_violations() == []


def test_a_refusal_is_replayed_too_and_the_key_is_not_a_second_try(
    client, make_offering, make_client
):
    # given a full offering: the first attempt under the key is refused
    full = make_offering(capacity=1)
    _, token = make_client()
    call(client, "post", hold_url(full), token, {"holder": "ann"})
    refused = call(client, "post", hold_url(full), token, {"holder": "bob"}, key="bob-1")
    # when a seat frees up and the client retries under the same key
    expire(*Reservation.objects.filter(holder="ann"), ago=timedelta(0))
    retry = call(client, "post", hold_url(full), token, {"holder": "bob"}, key="bob-1")
    # then the key's answer stands: it names one attempt, not "keep trying"
    assert refused.status_code == retry.status_code == 409
    assert error_code(retry) == "no_seats_available"
    assert retry["Idempotent-Replayed"] == "true"


def test_a_request_refused_before_it_ran_leaves_the_key_free(client, offering, make_client):
    _, token = make_client()
    bad = call(client, "post", hold_url(offering), token, {"holder": 7}, key="k-1")
    good = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="k-1")
    assert bad.status_code == 400
    assert good.status_code == 201
    assert good["Idempotent-Replayed"] == "false"


def test_a_change_that_fails_stores_nothing_and_leaves_the_key_free(db):
    # given a change that raises (what a transient database error does, answered 503)
    def failing() -> idempotency.Response:
        raise services.TransientConflict("raced")

    with pytest.raises(services.TransientConflict):
        idempotency.run_once(None, "k-503", "hash", failing)
    assert not IdempotencyKey.objects.exists()
    # when the client retries, the change runs
    answer = idempotency.run_once(
        None, "k-503", "hash", lambda: idempotency.Response(201, {"id": 1})
    )
    assert answer == idempotency.Response(201, {"id": 1})
    assert IdempotencyKey.objects.get(key="k-503").response_status == 201


@pytest.mark.parametrize("key", ["", " ", "has space", "x" * 256, "caf\u00e9"])
def test_a_malformed_key_is_a_400_naming_the_header(client, offering, make_client, key):
    _, token = make_client()
    response = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key=key)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_idempotency_key"
    assert response.json()["field"] == "Idempotency-Key"
    assert Reservation.objects.count() == 0


def test_an_expired_key_is_new_again_and_the_prune_deletes_expired_keys(
    client, offering, make_client, settings
):
    # given two keys, one past its lifetime
    _, token = make_client()
    first = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="young")
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    # when the old key comes back, it is a new request
    again = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    assert again.status_code == 201
    assert again.json()["id"] != first.json()["id"]
    # and the prune deletes what expired, nothing else
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    assert idempotency.prune_expired(batch=1) == 1
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["young"]
    stored = IdempotencyKey.objects.get(key="young")
    lifetime = (stored.expires_at - stored.created_at).total_seconds()
    assert lifetime == settings.RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS


def test_the_prune_goes_on_past_a_full_batch_until_no_expired_key_is_left(db):
    # given: five expired keys, more than one batch of the prune's
    now = timezone.now()
    IdempotencyKey.objects.bulk_create(
        IdempotencyKey(
            key=f"expired-{n}",
            request_hash="h",
            response_status=201,
            response_body={},
            created_at=now - timedelta(days=2),
            expires_at=now - timedelta(days=1),
        )
        for n in range(5)
    )
    # when: the prune runs in batches of two
    deleted = idempotency.prune_expired(batch=2)
    # then: every expired key is gone, not only the first batch
    assert (deleted, IdempotencyKey.objects.count()) == (5, 0)


def test_the_cleanups_hourly_prune_deletes_expired_idempotency_keys(client, offering, make_client):
    _, token = make_client()
    call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="young")
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    result = prune_task.run()  # the task's body, as the worker runs it
    assert result["idempotency_keys"] == 1
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["young"]
