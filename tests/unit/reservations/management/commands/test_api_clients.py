"""``manage.py api_clients``, as a provisioning script uses it: the token ``create`` and
``rotate`` print, alone on stdout, authenticates and reads the API; rotation with and without
``--revoke-others``; ``revoke`` by prefix, by whole token and ``--all``; ``deactivate`` and
``activate``; ``list`` (table and ``--json``) never shows a token or a digest; refusals name
what is wrong; each change is in the admin's history, never the token."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from reservations import clients
from reservations.commands import os_user
from reservations.models import ApiClient, ApiToken, Offering
from tests.support.api import call, error_code
from tests.support.commands import run_from_argv

pytestmark = pytest.mark.django_db


def api_clients(*args: str) -> tuple[str, str]:
    """``manage.py api_clients args`` in this process: its stdout and stderr."""
    out, err = StringIO(), StringIO()
    call_command("api_clients", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def new_token(*args: str) -> str:
    """The token ``create`` or ``rotate`` printed: stdout is that one line and nothing else."""
    out, _ = api_clients(*args)
    token = out.removesuffix("\n")
    assert token.startswith(clients.TOKEN_PREFIX) and "\n" not in token, out
    return token


def reads(client: Client, offering: Offering, token: str) -> int:
    """The status of a GET of the offering's availability with ``token``."""
    response = call(client, "get", f"/api/v1/offerings/{offering.pk}/availability", token)
    return int(response.status_code)


def valid(token: str) -> bool:
    return clients.authenticate(token) is not None


def history() -> list[tuple[str, str, str]]:
    """The admin history: (user, object, change message), oldest first."""
    return [
        (str(e.user), e.object_repr, e.get_change_message())
        for e in LogEntry.objects.order_by("pk")
    ]


def test_create_prints_only_a_token_that_authenticates_and_reads_its_offerings(
    client: Client, make_offering, capsys: pytest.CaptureFixture[str]
) -> None:
    mine, other = make_offering(name="mine"), make_offering(name="other")
    # no stdout= here: whatever reaches the process's stdout is captured, not just self.stdout
    call_command(
        "api_clients", "create", " checkout ", "--scopes", "read,write", "--offering", str(mine.pk)
    )
    captured = capsys.readouterr()
    token = captured.out.removesuffix("\n")
    assert token.startswith("rsv_") and len(token) == 47, captured.out
    stored = ApiToken.objects.get()
    assert stored.client.name == "checkout"
    assert "created API client 'checkout' (read,write; offerings " in captured.err
    assert stored.prefix in captured.err and token not in captured.err
    principal = clients.authenticate(token)
    assert principal is not None
    assert (principal.name, principal.can_read, principal.can_write, principal.all_offerings) == (
        "checkout",
        True,
        True,
        False,
    )
    assert reads(client, mine, token) == 200
    offering_not_found = call(client, "get", f"/api/v1/offerings/{other.pk}/availability", token)
    assert offering_not_found.status_code == 404
    assert error_code(offering_not_found) == "offering_not_found"
    # only the digest is stored, and the history names the prefix only
    assert stored.digest == clients.digest(token)
    assert token not in json.dumps(list(ApiToken.objects.values()), default=str)
    assert history() == [
        (
            "manage.py",
            "checkout",
            f"api_clients create (manage.py, by {os_user()}): created, token {stored.prefix}",
        ),
    ]


def test_create_takes_the_defaults_and_every_offering(client: Client, offering: Offering) -> None:
    token = new_token("create", "reader", "--all-offerings")
    created = ApiClient.objects.get(name="reader")
    assert (created.can_read, created.can_write, created.all_offerings) == (True, False, True)
    assert created.requests_per_minute == 600
    assert reads(client, offering, token) == 200
    write = call(client, "post", f"/api/v1/offerings/{offering.pk}/holds", token, {"holder": "a"})
    assert write.status_code == 403


def test_a_duplicate_name_exits_1_saying_why_and_prints_no_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    new_token("create", "checkout", "--all-offerings")
    capsys.readouterr()
    # the path manage.py takes: argument parsing, exit status (it closes the connection, so
    # nothing is read from the database after it)
    assert run_from_argv("api_clients", "create", "checkout", "--all-offerings") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "an API client named 'checkout' exists already" in captured.err
    assert "api_clients rotate checkout" in captured.err


def test_unknown_offering_ids_are_named_and_nothing_is_created(offering: Offering) -> None:
    wanted = ["--offering", str(offering.pk), "--offering", "999998", "--offering", "999999"]
    with pytest.raises(CommandError, match=r"no offering with id 999998, 999999: check the ids"):
        api_clients("create", "checkout", *wanted)
    assert not ApiClient.objects.exists()
    assert not ApiToken.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scopes", "read,admin"], "--scopes: unknown scope 'admin'"),
        (["--scopes", ","], "--scopes must not be empty"),
        (["--requests-per-minute", "0"], "--requests-per-minute must be between 1"),
    ],
)
def test_create_refuses_what_would_make_a_useless_client(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        api_clients("create", "checkout", "--all-offerings", *args)
    assert not ApiClient.objects.exists()


def test_rotate_with_revoke_others_refuses_the_old_token_at_once(
    client: Client, offering: Offering
) -> None:
    old = new_token("create", "checkout", "--all-offerings")
    assert reads(client, offering, old) == 200
    new = new_token("rotate", "checkout", "--revoke-others")
    assert new != old
    assert not valid(old)
    assert reads(client, offering, old) == 401
    assert reads(client, offering, new) == 200


def test_rotate_leaves_the_old_token_valid_until_it_is_revoked_by_prefix(
    client: Client, offering: Offering
) -> None:
    old = new_token("create", "checkout", "--all-offerings")
    out, err = api_clients("rotate", "checkout")
    new = out.removesuffix("\n")
    old_prefix = old[: clients.SHOWN_PREFIX_LENGTH]
    # the grace period: both tokens work, and stderr says how to end it
    assert valid(old) and valid(new)
    assert f"other token(s) stay valid: {old_prefix}" in err
    assert "api_clients revoke checkout --token PREFIX" in err
    out, _ = api_clients("revoke", "checkout", "--token", old_prefix)
    assert out == f"revoked 1 token(s) of 'checkout': {old_prefix}\n"
    assert reads(client, offering, old) == 401
    assert reads(client, offering, new) == 200
    # again: nothing left to revoke, said so, and no error (a script may retry)
    out, _ = api_clients("revoke", "checkout", "--token", old_prefix)
    assert out == "revoked 0 token(s) of 'checkout'; 1 already revoked\n"


def test_revoke_by_whole_token_or_all_and_unknown_prefix(
    client: Client, offering: Offering
) -> None:
    first = new_token("create", "checkout", "--all-offerings")
    second = new_token("rotate", "checkout")
    third = new_token("rotate", "checkout")
    api_clients("revoke", "checkout", "--token", first)
    assert [valid(t) for t in (first, second, third)] == [False, True, True]
    with pytest.raises(CommandError, match=r"'checkout' has no token rsv_nothere…; .* list"):
        api_clients("revoke", "checkout", "--token", "rsv_nothere")
    # a prefix of another client's token is not this client's
    other = new_token("create", "other", "--all-offerings")
    with pytest.raises(CommandError, match="has no token"):
        api_clients("revoke", "checkout", "--token", other[: clients.SHOWN_PREFIX_LENGTH])
    out, _ = api_clients("revoke", "checkout", "--all")
    assert out.startswith("revoked 2 token(s) of 'checkout': ")
    assert out.endswith("; 1 already revoked\n")
    assert [valid(t) for t in (first, second, third, other)] == [False, False, False, True]
    assert reads(client, offering, third) == 401


def test_deactivate_refuses_every_token_and_activate_accepts_the_unrevoked_again(
    client: Client, offering: Offering
) -> None:
    first = new_token("create", "checkout", "--all-offerings")
    second = new_token("rotate", "checkout")
    revoked = new_token("rotate", "checkout")
    api_clients("revoke", "checkout", "--token", revoked)
    assert [valid(t) for t in (first, second)] == [True, True]
    out, _ = api_clients("deactivate", "checkout")
    assert out == "deactivated 'checkout': every one of its tokens is refused\n"
    assert [valid(t) for t in (first, second, revoked)] == [False, False, False]
    assert reads(client, offering, first) == 401
    out, _ = api_clients("deactivate", "checkout")
    assert out == "'checkout' is already deactivated; nothing changed\n"
    api_clients("activate", "checkout")
    assert [valid(t) for t in (first, second, revoked)] == [True, True, False]
    assert reads(client, offering, second) == 200


def test_an_unknown_client_is_refused_saying_where_to_look() -> None:
    for action in (["rotate"], ["revoke", "--all"], ["deactivate"], ["activate"]):
        with pytest.raises(CommandError, match=r"no API client named 'nobody'; .*api_clients list"):
            api_clients(action[0], "nobody", *action[1:])
    assert not ApiToken.objects.exists()


def test_list_json_parses_and_shows_prefixes_never_a_token_or_digest(
    client: Client, make_offering
) -> None:
    mine = make_offering(name="mine")
    old = new_token(
        "create", "checkout", "--scopes", "write", "--offering", str(mine.pk),
        "--requests-per-minute", "30",
    )  # fmt: skip
    new = new_token("rotate", "checkout", "--revoke-others")
    reader = new_token("create", "analytics", "--all-offerings")
    api_clients("deactivate", "analytics")
    assert reads(client, mine, old) == 401  # revoked, and it records no use
    call(client, "post", f"/api/v1/offerings/{mine.pk}/holds", new, {"holder": "ann"})
    out, _ = api_clients("list", "--json")
    listed = json.loads(out)
    assert [c["name"] for c in listed] == ["analytics", "checkout"]
    analytics, checkout = listed
    assert (analytics["scopes"], analytics["all_offerings"], analytics["active"]) == (
        ["read"],
        True,
        False,
    )
    assert checkout["scopes"] == ["write"]
    assert (checkout["all_offerings"], checkout["offerings"]) == (False, [mine.pk])
    assert (checkout["requests_per_minute"], checkout["active"]) == (30, True)
    old_listed, new_listed = checkout["tokens"]
    assert old_listed["prefix"] == old[: clients.SHOWN_PREFIX_LENGTH]
    assert old_listed["revoked_at"] is not None and old_listed["last_used_at"] is None
    assert new_listed["prefix"] == new[: clients.SHOWN_PREFIX_LENGTH]
    assert new_listed["revoked_at"] is None and new_listed["last_used_at"] is not None
    assert set(new_listed) == {"prefix", "created_at", "last_used_at", "revoked_at"}
    table, _ = api_clients("list")
    for shown in (out, table):
        for token in (old, new, reader):
            assert token not in shown
            assert clients.digest(token) not in shown
    lines = table.splitlines()
    assert lines[0].split() == ["NAME", "SCOPES", "OFFERINGS", "RATE/MIN", "ACTIVE"]
    assert lines[1].split() == ["analytics", "read", "all", "600", "no"]
    assert lines[3].split() == ["checkout", "write", str(mine.pk), "30", "yes"]
    assert lines[4].startswith(f"  token {old[:12]}  created ") and "last used never" in lines[4]
    assert lines[5].startswith(f"  token {new[:12]}  created ") and "revoked no" in lines[5]


def test_list_of_no_clients_says_so() -> None:
    assert api_clients("list") == ("no API clients\n", "")
    assert api_clients("list", "--json") == ("[]\n", "")


def test_each_change_is_in_the_admin_history_under_the_operator_never_the_token() -> None:
    User.objects.create_user("dora", is_staff=True)
    first = new_token("create", "checkout", "--all-offerings", "--by", "dora")
    second = new_token("rotate", "checkout", "--revoke-others", "--by", "dora")
    api_clients("deactivate", "checkout", "--by", "carol")
    p1, p2 = first[:12], second[:12]
    assert history() == [
        ("dora", "checkout", f"api_clients create (manage.py, by dora): created, token {p1}"),
        ("dora", "checkout", f"api_clients rotate (manage.py, by dora): issued token {p2}"),
        ("dora", f"{p1}… (checkout)", "api_clients rotate (manage.py, by dora): revoked"),
        ("manage.py", "checkout", "api_clients deactivate (manage.py, by carol): deactivated"),
    ]
    assert not User.objects.get(username="manage.py").is_active
