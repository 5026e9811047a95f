"""Clients of the admin, logged in (``force_login``: the login form has tests of its own)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.test import Client


def messages_of(response: Any) -> list[str]:
    """The admin's messages to the user (``django.contrib.messages``) of ``response``."""
    return [str(m) for m in get_messages(response.wsgi_request)]


def logged_in(user: User) -> Client:
    """A client with ``user``'s session."""
    client = Client()
    client.force_login(user)
    return client


def login_staff(username: str, *codenames: str, app_label: str | None = None) -> Client:
    """A new staff user holding the permissions ``codenames`` (of ``app_label``'s models when
    given), logged in."""
    user = User.objects.create_user(username, password="x", is_staff=True)
    permissions = Permission.objects.filter(codename__in=codenames)
    if app_label is not None:
        permissions = permissions.filter(content_type__app_label=app_label)
    user.user_permissions.set(permissions)
    return logged_in(user)


@pytest.fixture
def root_client(db: None) -> Client:
    """A superuser named ``root``, logged in."""
    return logged_in(User.objects.create_superuser("root", "root@example.com", "pw"))
