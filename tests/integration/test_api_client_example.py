"""docs/API.md's Python client ("A client in Python"), run as written against a live gunicorn:
hold, renew, confirm, cancel, a retried hold under one Idempotency-Key, and a 429 honoured
by waiting its Retry-After."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from reservations import clients, services
from reservations.models import ApiClient, Reservation

pytestmark = [pytest.mark.slow]

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"


@pytest.fixture(autouse=True)
def _no_earlier_requests(clear_rate_limits: None) -> None:
    pass


def documented_client() -> dict[str, Any]:
    """The names docs/API.md's client block defines, as running it defines them."""
    text = API_DOC.read_text()
    found = re.search(r"<!-- api-client:start -->\n```python\n(.*?)```", text, re.DOTALL)
    assert found, "docs/API.md has no api-client block"
    names: dict[str, Any] = {}
    exec(compile(found.group(1), str(API_DOC), "exec"), names)  # our own docs, run as written
    return names


def token_for(name: str, **fields: Any) -> str:
    client = ApiClient.objects.create(name=name, can_write=True, all_offerings=True, **fields)
    return clients.issue_token(client)


def test_the_documented_client_holds_renews_confirms_and_cancels(web):
    names = documented_client()
    api = names["ReservationsClient"](f"{web.base_url}/api/v1", token_for("docs"))
    offering = services.create_offering("docs", capacity=2)
    # hold, renew, confirm
    hold = api.hold(offering.pk, "ann", ttl_seconds=300)
    assert (hold["status"], hold["version"], hold["holder"]) == ("held", 1, "ann")
    hold = api.renew(hold, ttl_seconds=600)
    assert hold["version"] == 2
    hold = api.confirm(hold)
    assert hold["status"] == "confirmed"
    # cancel a second one; cancelling it again is an ApiProblem with its code
    other = api.hold(offering.pk, "bob")
    assert api.cancel(other)["status"] == "cancelled"
    with pytest.raises(names["ApiProblem"]) as refused:
        api.cancel(other)
    assert refused.value.code == "not_held"
    assert api.get(hold["id"])["status"] == "confirmed"


def test_a_retry_under_the_same_key_takes_one_seat(web):
    names = documented_client()
    api = names["ReservationsClient"](f"{web.base_url}/api/v1", token_for("retry"))
    offering = services.create_offering("docs", capacity=5)
    body = {"holder": "ann"}
    # the request sent twice under one key, as after a lost answer
    first = api.send("POST", f"/offerings/{offering.pk}/holds", body, key="order-1")
    again = api.send("POST", f"/offerings/{offering.pk}/holds", body, key="order-1")
    assert first == again
    assert Reservation.objects.filter(offering=offering).count() == 1


def test_a_429_is_retried_after_its_retry_after(web, monkeypatch):
    names = documented_client()
    slept: list[float] = []
    monkeypatch.setattr(names["time"], "sleep", slept.append)
    api = names["ReservationsClient"](
        f"{web.base_url}/api/v1", token_for("limited", requests_per_minute=2), attempts=3
    )
    offering = services.create_offering("docs", capacity=5)
    url = f"/offerings/{offering.pk}/availability"
    api.send("GET", url)
    api.send("GET", url)
    # the third is refused: the client waits Retry-After before each retry (the test does not
    # really wait a minute), then gives the refusal up as an ApiProblem
    with pytest.raises(names["ApiProblem"]) as refused:
        api.send("GET", url)
    assert refused.value.code == "rate_limited"
    assert len(slept) == 2
    assert all(1 <= seconds <= 60 for seconds in slept)
