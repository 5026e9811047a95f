"""The admin's front door, as the settings every environment shares configure it
(config.settings.base): staff passwords are validated, and repeated failed logins lock the
username out from that address."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

PASSWORD = "correct-horse-battery-staple-9"


@pytest.fixture
def staff(db: None) -> User:
    return User.objects.create_superuser("ops", "ops@example.com", PASSWORD)


def login(client: Client, password: str, username: str = "ops", **extra: Any) -> Any:
    return client.post(
        "/admin/login/?next=/admin/",
        {"username": username, "password": password, "next": "/admin/"},
        **extra,
    )


def logged_in(client: Client) -> bool:
    return client.get("/admin/").status_code == 200


@pytest.mark.parametrize("password", ["a", "12345678901234", "password1234", "ops-ops-ops-ops"])
def test_a_weak_staff_password_is_refused_in_the_admin(admin_client, password):
    response = admin_client.post(
        "/admin/auth/user/add/",
        {"username": "ops-ops-ops-ops", "password1": password, "password2": password},
    )
    assert response.status_code == 200  # the form again, with its errors
    assert response.context["adminform"].form.errors
    assert not User.objects.filter(username="ops-ops-ops-ops").exists()


def test_a_strong_staff_password_is_accepted(admin_client):
    response = admin_client.post(
        "/admin/auth/user/add/",
        {"username": "newops", "password1": PASSWORD, "password2": PASSWORD},
    )
    assert response.status_code == 302
    assert User.objects.get(username="newops").check_password(PASSWORD)


def test_after_repeated_failures_even_the_right_password_is_refused(staff, settings):
    # given an attacker guessing from one address
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(client, "wrong").status_code == 200  # the form again
    assert login(client, "wrong").status_code == 429  # the limit reached
    # when the right password comes next
    response = login(client, PASSWORD)
    # then it is refused, and no session was opened
    assert response.status_code == 429
    assert not logged_in(client)
    # while the same user from another address still gets in
    elsewhere = Client(REMOTE_ADDR="192.0.2.7")
    assert login(elsewhere, PASSWORD).status_code == 302
    assert logged_in(elsewhere)


def test_a_few_failures_then_success_start_the_count_again(staff, settings):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "wrong")
    assert login(client, PASSWORD).status_code == 302
    client.logout()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "wrong")
    assert login(client, PASSWORD).status_code == 302
