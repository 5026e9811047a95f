"""API clients in the admin: a token is shown once, stored as a digest, and revocable."""

from __future__ import annotations

import re

from django.contrib.admin.models import LogEntry
from django.test import Client

from reservations.models import ApiClient, ApiToken

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
