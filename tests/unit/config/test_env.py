"""Strict readers of the environment (config.env). DATABASE_URL: one host as before; libpq's
multi-host failover form with the writable session picked; every refusal names the variable and
never repeats the URL (it may carry a password). DATABASE_POOLING and DATABASE_DIRECT_URL: the
aliases, prepared statements and server-side cursors behind a transaction pooler, and their
refusals."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.backends.postgresql.base import DatabaseWrapper

from config.env import SESSION_ALIAS, database_aliases, parse_database_url, prepared_statements
from tests.support.child_python import run_python


def parse(url: str) -> dict[str, Any]:
    return parse_database_url("DATABASE_URL", url)


def test_one_host_gives_the_entry_it_always_gave() -> None:
    assert parse("postgres://app:s%40cret@db.internal:6432/reservations?sslmode=require") == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "reservations",
        "USER": "app",
        "PASSWORD": "s@cret",
        "HOST": "db.internal",
        "PORT": "6432",
        "OPTIONS": {"sslmode": "require"},
    }
    assert parse("postgres://app@/reservations?host=/run/postgresql")["HOST"] == "/run/postgresql"
    assert parse("postgresql://app@[::1]:5432/reservations")["HOST"] == "::1"


def test_several_hosts_become_libpq_lists_with_a_per_host_connect_timeout() -> None:
    entry = parse(
        "postgres://app:pw@db1.internal:5432,db2.internal,[fd00::3]:5433/reservations"
        "?target_session_attrs=read-write"
    )
    assert entry["HOST"] == "db1.internal,db2.internal,fd00::3"
    # libpq takes one port or one per host: a host written without one gets the default
    assert entry["PORT"] == "5432,5432,5433"
    assert entry["OPTIONS"] == {"target_session_attrs": "read-write", "connect_timeout": "5"}
    explicit = parse("postgres://app@a,b/r?target_session_attrs=primary&connect_timeout=2")
    assert explicit["OPTIONS"]["connect_timeout"] == "2"
    assert explicit["PORT"] == ""


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgres://app:pw@db1,db2/r", "names 2 hosts but no target_session_attrs"),
        ("postgres://app:pw@db1,,db2/r?target_session_attrs=read-write", "host 2 of 3 is empty"),
        ("postgres://app:pw@db1,:5433/r?target_session_attrs=read-write", "host 2 of 2 is empty"),
        ("postgres://app:pw@db1:54x2/r", "the port of the host is not a number"),
        ("postgres://app:pw@db1,db2:0/r?target_session_attrs=primary", "port of host 2 of 2"),
        ("postgres://app:pw@[::1/r", "an IPv6 host needs [ and ]"),
        ("postgres://app:pw@a,[::1]x/r?target_session_attrs=primary", "host 2 of 2 is not written"),
        ("postgres://app:pw@db1/r?target_session_attrs=standby", "every write fails"),
        ("postgres://app:pw@db1/r?target_session_attrs=primry", "must be one of"),
        ("postgres://app:pw@a,b/r?target_session_attrs=primary&host=/tmp", "cannot be combined"),
        ("mysql://app:pw@db1/r", "only postgres:// URLs"),
        ("postgres://app:pw@db1/", "the database name is missing"),
    ],
)
def test_a_bad_url_is_refused_naming_the_variable_not_the_password(url: str, says: str) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        parse(url)
    assert str(refused.value).startswith("DATABASE_URL")
    assert says in str(refused.value)
    assert "pw" not in str(refused.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.django_db
def test_a_dead_first_host_is_passed_over_for_the_writable_one() -> None:
    """The failover form through Django and psycopg for real: the first host refuses
    connections, libpq goes on to the test server and the session there takes writes."""
    live = connection.settings_dict
    dead = _closed_port()
    entry = parse(
        f"postgres://{live['USER'] or 'postgres'}@127.0.0.1:{dead},127.0.0.1:5432/"
        f"{live['NAME']}?target_session_attrs=read-write"
    )
    # the live server as the suite reaches it (a socket directory for embedded servers)
    entry["HOST"] = f"127.0.0.1,{live['HOST'] or 'localhost'}"
    entry["PORT"] = f"{dead},{live['PORT'] or 5432}"
    entry["PASSWORD"] = live["PASSWORD"]
    wrapper = DatabaseWrapper({**live, **entry}, alias="failover-form")
    try:
        with wrapper.cursor() as cur:
            cur.execute("SHOW transaction_read_only")
            assert cur.fetchone() == ("off",)
            cur.execute("SELECT current_database()")
            assert cur.fetchone() == (live["NAME"],)
        assert wrapper.connection.info.port != dead
    finally:
        wrapper.close()


# --- DATABASE_POOLING and DATABASE_DIRECT_URL -------------------------------------------------


DIRECT = "postgres://app@db.internal:5432/reservations"

POOLED = "postgres://app@pgbouncer.internal:6432/reservations"


def _settings_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATABASE_")}
    env.update({"DJANGO_SETTINGS_MODULE": "config.settings.test", "DATABASE_URL": POOLED})
    env.update(extra)
    return env


SHOW_DATABASE_SETTINGS = (
    "import django; django.setup(); from django.conf import settings as s; "
    "print(s.DATABASE_POOLING, s.DATABASE_SESSION_ALIAS, s.DATABASE_PREPARED_STATEMENTS, "
    "sorted(s.DATABASES))"
)


def test_without_pooling_there_is_one_alias_as_before() -> None:
    aliases = database_aliases(DIRECT, "", "none", conn_max_age=60)
    assert list(aliases) == ["default"]
    assert "DISABLE_SERVER_SIDE_CURSORS" not in aliases["default"]
    assert aliases["default"]["CONN_MAX_AGE"] == 60


def test_transaction_pooling_adds_the_direct_alias_and_turns_server_side_cursors_off() -> None:
    aliases = database_aliases(POOLED, DIRECT, "transaction", conn_max_age=30)
    assert aliases["default"]["HOST"] == "pgbouncer.internal"
    assert aliases["default"]["DISABLE_SERVER_SIDE_CURSORS"] is True
    session = aliases[SESSION_ALIAS]
    assert (session["HOST"], session["PORT"], session["CONN_MAX_AGE"]) == (
        "db.internal",
        "5432",
        30,
    )
    assert session["TEST"] == {"MIRROR": "default"}  # the tests' database, not one of its own


def test_transaction_pooling_without_a_direct_url_is_refused_naming_it() -> None:
    with pytest.raises(ImproperlyConfigured, match="DATABASE_DIRECT_URL"):
        database_aliases(POOLED, "", "transaction", conn_max_age=60)


def test_prepared_statements_are_off_behind_a_transaction_pooler_only() -> None:
    assert prepared_statements("none") is True
    assert prepared_statements("transaction") is False


def test_the_settings_read_the_pooling_from_the_environment_and_refuse_a_bad_value() -> None:
    plain = run_python(SHOW_DATABASE_SETTINGS, _settings_env(), check=True)
    assert plain.stdout.split() == ["none", "default", "True", "['default']"]
    pooled = run_python(
        SHOW_DATABASE_SETTINGS,
        _settings_env(DATABASE_POOLING="transaction", DATABASE_DIRECT_URL=DIRECT),
        check=True,
    )
    assert pooled.stdout.split() == ["transaction", "locks", "False", "['default',", "'locks']"]
    for env, named in (
        ({"DATABASE_POOLING": "statement"}, "DATABASE_POOLING"),
        ({"DATABASE_POOLING": "transaction"}, "DATABASE_DIRECT_URL"),
        ({"DATABASE_DIRECT_URL": "mysql://x/y"}, "DATABASE_DIRECT_URL"),
    ):
        refused = run_python(SHOW_DATABASE_SETTINGS, _settings_env(**env))
        assert refused.returncode != 0
        assert "ImproperlyConfigured" in refused.stderr and named in refused.stderr, env
