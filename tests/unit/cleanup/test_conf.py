"""The cleanup's settings object (cleanup.conf) and the environment variables the project reads
(tests/env_names.py): docs/CONFIGURATION.md's tables match them, the names stay fewer than 60
and are read through the strict readers, a variable no longer read stops the start, bad values
and broken rules are refused naming the variable, what a deployer sets in the environment and
what a test overrides is what the code reads."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from cleanup.conf import (
    DEFAULT_TEXT,
    DOC,
    ENV,
    ENVIRONMENT,
    RETIRED_VARIABLES,
    CleanupSettings,
    cleanup_settings,
)
from config.settings import base
from tests.support import ROOT, env_names
from tests.support.child_python import run_with

# The prefixes of the variables the object owns: a table row naming one it does not declare is
# stale.
OWNED_PREFIXES = ("CLEANUP_", "METRICS_", "WORKER_METRICS_")
BACKTICKED = re.compile(r"`([^`]+)`")


# The headings of docs/CONFIGURATION.md's two tables: the environment variables, and the
# cleanup's tuning settings (Django settings only).
VARIABLES = "## Settings"
TUNING = "### Tuning settings: Django settings, not variables"


def table_rows(heading: str = VARIABLES) -> list[tuple[list[str], list[str], str]]:
    """(names, defaults, meaning) of each row of the table under ``heading`` in
    docs/CONFIGURATION.md (up to the next heading); a row that documents several names
    separates them, and their defaults, with " / "."""
    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    section = section.split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        names, defaults, meaning = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows.append(
            (
                [BACKTICKED.fullmatch(n.strip()).group(1) for n in names.split(" / ")],  # type: ignore[union-attr]
                [d.strip() for d in defaults.split(" / ")],
                meaning,
            )
        )
    return rows


def documented_default(spec: dataclasses.Field[Any]) -> str:
    """How the settings table states a field's default."""
    if spec.metadata[DEFAULT_TEXT]:
        return str(spec.metadata[DEFAULT_TEXT])
    value = spec.default
    if value in ("", ()):
        return "empty"
    if isinstance(value, tuple):
        value = ",".join(value)
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"`{value}`"


def table_problems(
    rows: list[tuple[list[str], list[str], str]], *, environment: bool = True
) -> list[str]:
    """What a table gets wrong against the object: a setting without a row, with another
    default or without a meaning, documented twice, or a row for a setting it does not have.
    ``environment``: the variables' table (the fields read from the environment), else the
    tuning table (the rest)."""
    specs = [
        spec
        for spec in dataclasses.fields(CleanupSettings)
        if spec.metadata[ENVIRONMENT] == environment
    ]
    declared = {spec.metadata[ENV] for spec in specs}
    problems = [
        f"{' / '.join(names)}: {len(names)} names, {len(defaults)} defaults"
        for names, defaults, _ in rows
        if set(names) & declared and len(names) != len(defaults)
    ]
    documented: dict[str, tuple[str, str]] = {}
    for names, defaults, meaning in rows:
        for name, default in zip(names, defaults, strict=False):
            if name in documented:
                problems.append(f"{name}: documented twice")
            documented[name] = (default, meaning)
    for spec in specs:
        env = spec.metadata[ENV]
        if env not in documented:
            problems.append(f"{env}: no row")
        elif documented[env][0] != documented_default(spec):
            documented_as, declared_default = documented[env][0], documented_default(spec)
            problems.append(f"{env}: {documented_as} in the docs, {declared_default} in the object")
        elif not documented[env][1]:
            problems.append(f"{env}: no meaning")
    problems += [
        f"{name}: no such setting"
        for name in documented
        if (name.startswith(OWNED_PREFIXES) or not environment)
        and name not in declared
        and not (environment and name in READ_ELSEWHERE)
    ]
    return problems


# Variables with a prefix of the object's that something other than the object reads.
READ_ELSEWHERE = {"WORKER_METRICS_DIR"}  # cleanup.metrics_boot, before the settings exist


def test_the_settings_table_documents_every_setting_with_its_default_and_nothing_stale() -> None:
    assert table_problems(table_rows()) == []


def test_the_tuning_table_documents_every_tuning_setting_with_its_default() -> None:
    assert table_problems(table_rows(TUNING), environment=False) == []


def test_the_table_check_notices_a_missing_row_a_wrong_default_and_a_stale_row() -> None:
    rows = [row for row in table_rows() if row[0] != ["CLEANUP_LEASE_SECONDS"]]
    rows = [
        (names, ["`99`"] + defaults[1:] if names[0] == "CLEANUP_EVENTS_QUEUE" else defaults, m)
        for names, defaults, m in rows
    ]
    rows.append((["CLEANUP_SHARD_COUNT"], ["`4`"], "gone"))
    assert table_problems(rows) == [
        "CLEANUP_EVENTS_QUEUE: `99` in the docs, `reservation-events` in the object",
        "CLEANUP_LEASE_SECONDS: no row",
        "CLEANUP_SHARD_COUNT: no such setting",
    ]


def test_every_setting_has_a_one_line_doc() -> None:
    missing = [
        spec.metadata[ENV]
        for spec in dataclasses.fields(CleanupSettings)
        if not spec.metadata[DOC] or "\n" in spec.metadata[DOC]
    ]
    assert missing == []


VALID = CleanupSettings()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"lease_seconds": 0}, "CLEANUP_LEASE_SECONDS=0 must be >= 1"),
        ({"max_message_bytes": 1024}, "CLEANUP_MAX_MESSAGE_BYTES=1024 must be >= 65536"),
        ({"autoscale_interval": 0.1}, "CLEANUP_AUTOSCALE_INTERVAL=0.1 must be >= 0.2"),
        (
            {"release_mode": "bulk"},
            "CLEANUP_RELEASE_MODE='bulk': expected one of 'adaptive', 'single', 'batch'",
        ),
        (
            {"release_batch_size": 1001},
            "CLEANUP_RELEASE_BATCH_SIZE=1001 must be <= 1000",
        ),
        (
            {"rabbitmq_queue_type": "stream"},
            "CLEANUP_RABBITMQ_QUEUE_TYPE='stream': expected one of 'classic', 'quorum'",
        ),
        (
            # the broker's fixed x-delivery-limit is a backstop: the project's cap acts first
            {"rabbitmq_queue_type": "quorum", "max_deliveries": 100},
            "CLEANUP_MAX_DELIVERIES=100 must be below the quorum queues' x-delivery-limit (100)",
        ),
        (
            {"worker_pools": ("prefork", "thread")},
            "CLEANUP_WORKER_POOLS names 'thread': expected among prefork, threads, solo, gevent",
        ),
        (
            {"visibility_timeout": 60},
            "CLEANUP_VISIBILITY_TIMEOUT=60 must exceed CLEANUP_TASK_TIME_LIMIT + "
            "CLEANUP_RETRY_BACKOFF_MAX (60)",
        ),
        (
            {"max_deliveries": 5},
            "CLEANUP_MAX_DELIVERIES=5 must exceed CLEANUP_MAX_RETRIES=5",
        ),
        (
            {"task_soft_time_limit": 30},
            "CLEANUP_TASK_SOFT_TIME_LIMIT must be below CLEANUP_TASK_TIME_LIMIT",
        ),
        (
            {"autoscale_utilization": 1.5},
            "CLEANUP_AUTOSCALE_SLO_TARGET and CLEANUP_AUTOSCALE_UTILIZATION must be <= 1",
        ),
        (
            {"remote_control_commands": ("none", "ping")},
            "CLEANUP_REMOTE_CONTROL_COMMANDS: 'none' turns remote control off and stands alone",
        ),
    ],
)
def test_a_bad_value_or_a_broken_rule_is_refused_naming_the_variable(
    changes: dict[str, Any], words: str
) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        dataclasses.replace(VALID, **changes)
    assert str(refused.value).startswith(words)


def test_the_defaults_keep_every_rule_and_the_sweep_budget_is_half_the_soft_limit() -> None:
    assert VALID.release_mode == "adaptive"
    assert VALID.sweep_time_budget == VALID.task_soft_time_limit / 2 == 12.5
    assert CleanupSettings(sweep_time_budget=3).sweep_time_budget == 3


def test_the_repr_leaves_out_the_token_and_the_counter_url() -> None:
    shown = repr(CleanupSettings(metrics_token="t0ken-9f8e", counter_redis_url="redis://:pw9@r/1"))
    assert "t0ken-9f8e" not in shown and "pw9" not in shown
    assert "release_queue='cleanup'" in shown


def test_what_a_test_overrides_is_what_the_code_reads(settings: Any) -> None:
    settings.CLEANUP_RELEASE_BATCH_SIZE = 7
    settings.CLEANUP_CAPACITY_HEADROOM = 0  # an int where the field is a float
    settings.CLEANUP_REMOTE_CONTROL_COMMANDS = ["ping"]
    now = cleanup_settings()
    assert now.release_batch_size == 7
    assert now.capacity_headroom == 0.0 and isinstance(now.capacity_headroom, float)
    assert now.remote_control_commands == ("ping",)
    with override_settings(CLEANUP_RELEASE_BATCH_SIZE=9):
        assert cleanup_settings().release_batch_size == 9
    assert cleanup_settings().release_batch_size == 7


def test_an_override_that_breaks_a_rule_is_refused_when_read(settings: Any) -> None:
    settings.CLEANUP_RELEASE_MODE = "bulk"
    with pytest.raises(ImproperlyConfigured, match="CLEANUP_RELEASE_MODE='bulk'"):
        cleanup_settings()


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("CLEANUP_COUNTER_REDIS_URL", None, "CLEANUP_COUNTER_REDIS_URL=None is not a string"),
        ("CLEANUP_LEASE_SECONDS", 2.5, "CLEANUP_LEASE_SECONDS=2.5 is not an integer"),
        ("CLEANUP_MAX_CLAIMS", True, "CLEANUP_MAX_CLAIMS=True is not an integer"),
        (
            "METRICS_ALLOW_IPS",
            "10.0.0.0/8",
            "METRICS_ALLOW_IPS='10.0.0.0/8' is not a list of strings",
        ),
    ],
)
def test_an_override_of_the_wrong_type_is_refused_naming_the_setting(
    settings: Any, name: str, value: object, words: str
) -> None:
    setattr(settings, name, value)
    with pytest.raises(ImproperlyConfigured) as refused:
        cleanup_settings()
    assert str(refused.value) == words


READ = (
    "import django, json; django.setup(); from cleanup.conf import cleanup_settings as c; "
    "from django.conf import settings; s = c(); print(json.dumps([s.max_queue_depth, "
    "s.autoscale_cooldown, list(s.remote_control_commands), s.counter_redis_url, "
    "s.sweep_time_budget, settings.CELERY_WORKER_ENABLE_REMOTE_CONTROL]))"
)


def test_what_the_environment_sets_is_what_the_code_reads() -> None:
    out = run_with(
        READ,
        CLEANUP_MAX_QUEUE_DEPTH="77",
        CLEANUP_AUTOSCALE_COOLDOWN="12.5",
        CLEANUP_REMOTE_CONTROL_COMMANDS="ping, stats",
    )
    assert out.returncode == 0, out.stderr[-800:]
    depth, cooldown, commands, counter_url, budget, remote_control = json.loads(out.stdout)
    assert (depth, cooldown, commands, remote_control) == (77, 12.5, ["ping", "stats"], True)
    # computed defaults: the counters in the broker's Redis; half the test settings' soft limit
    assert counter_url == django_settings.CELERY_BROKER_URL
    assert budget == 4.0


def test_remote_control_none_turns_the_remote_control_consumer_off() -> None:
    out = run_with(READ, CLEANUP_REMOTE_CONTROL_COMMANDS="none")
    assert out.returncode == 0, out.stderr[-800:]
    _, _, commands, _, _, remote_control = json.loads(out.stdout)
    assert (commands, remote_control) == ([], False)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"CLEANUP_AUTOSCALE_COOLDOWN": "soon"},
            "CLEANUP_AUTOSCALE_COOLDOWN='soon' is not a number",
        ),
        (
            {"CLEANUP_RABBITMQ_QUEUE_TYPE": "stream"},
            "CLEANUP_RABBITMQ_QUEUE_TYPE='stream': expected",
        ),
        # the test settings: time limit 10 + backoff cap 2
        ({"CLEANUP_VISIBILITY_TIMEOUT": "12"}, "CLEANUP_VISIBILITY_TIMEOUT=12 must exceed"),
    ],
)
def test_start_up_fails_naming_the_variable(env: dict[str, str], words: str) -> None:
    out = run_with("import django; django.setup()", **env)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


# --- the environment's names (tests/env_names.py) ------------------------------------------

# Reads past the strict readers, each for a reason: they run before Django's settings exist,
# or the variable is a library's that the process sets itself.
RAW_READS = {
    # stdlib only, before the settings: the worker's metrics directory is prepared before
    # prometheus_client is imported (the port is checked again by the settings)
    ("cleanup/metrics_boot.py", "WORKER_METRICS_PORT"),
    ("cleanup/metrics_boot.py", "WORKER_METRICS_DIR"),
    # prometheus_client's own variable, set by gunicorn.conf.py and cleanup.metrics_boot
    ("cleanup/operations/console/endpoints.py", "PROMETHEUS_MULTIPROC_DIR"),
    ("cleanup/operations/worker_metrics.py", "PROMETHEUS_MULTIPROC_DIR"),
    # gunicorn's configuration file, read by gunicorn's master before any Django import
    ("gunicorn.conf.py", "WEB_METRICS_DIR"),
}
# The budget: a new variable is a decision each deployment must know about; a value that is not
# one belongs in a constant or a tuning setting (cleanup.conf.tuning).
MAX_NAMES = 59


def documented_variables() -> set[str]:
    return {name for names, _, _ in table_rows() for name in names}


def test_the_settings_table_lists_exactly_the_variables_the_code_reads() -> None:
    read = env_names.names()
    documented = documented_variables()
    assert sorted(read - documented) == [], "read but not in docs/CONFIGURATION.md's table"
    assert sorted(documented - read) == [], "in docs/CONFIGURATION.md's table but never read"


def test_the_product_reads_fewer_than_sixty_environment_variables() -> None:
    assert len(env_names.names()) <= MAX_NAMES, sorted(env_names.names())


# The OpenTelemetry SDK's and sentry-sdk's own variables, read by those libraries: the project
# only checks whether one is set (cleanup.tracing, cleanup.error_reports) to decide whether to
# load them. Outside the budget, in docs/CONFIGURATION.md's table of the libraries' variables.
LIBRARIES = "### Tracing and error reports: the libraries' own variables"


def test_the_libraries_variables_the_project_checks_are_documented_apart_and_never_budgeted() -> (
    None
):
    from cleanup import error_reports, tracing

    checked = {
        *tracing.ENDPOINT_VARIABLES,
        tracing.DISABLED_VARIABLE,
        tracing.EXPORTER_VARIABLE,
        *tracing.PROTOCOL_VARIABLES,
        error_reports.DSN_VARIABLE,
    }
    documented = {name for names, _, _ in table_rows(LIBRARIES) for name in names}
    assert checked <= documented
    assert not checked & env_names.names()
    assert not documented & documented_variables()


def test_every_variable_is_read_through_the_strict_readers() -> None:
    reads = env_names.reads()
    raw = {(read.path, read.name) for read in reads if read.raw and read.name}
    assert sorted(raw - RAW_READS) == []
    # a name the scan cannot resolve is a reader's own parameter, in the readers' module only
    unresolved = {read.path for read in reads if read.name is None}
    assert unresolved == {"config/env.py"}


def test_no_retired_variable_is_read_and_every_one_stops_the_start_naming_it() -> None:
    retired = {**RETIRED_VARIABLES, **base._RETIRED}
    assert sorted(set(retired) & env_names.names()) == []
    out = run_with("import django; django.setup()", **dict.fromkeys(retired, "1"))
    assert out.returncode != 0
    refused = out.stderr.strip().splitlines()[-1]
    assert refused.startswith("django.core.exceptions.ImproperlyConfigured: ")
    for name, where in retired.items():
        assert f"{name} is no longer read from the environment: {where}" in refused


def test_a_retired_variable_left_empty_counts_as_unset() -> None:
    out = run_with("import django; django.setup()", CLEANUP_RELEASE_MODE="")
    assert out.returncode == 0, out.stderr[-800:]


def test_a_tuning_setting_is_never_asked_of_the_environment_and_takes_a_chosen_value() -> None:
    asked: list[str] = []

    def read(name: str, kind: type, default: object) -> object:
        asked.append(name)
        return default

    chosen = CleanupSettings.from_environment(
        read, defaults={"CLEANUP_RELEASE_MODE": "single", "CLEANUP_SWEEP_MAX_BATCHES": 3}
    )
    tuning = {
        spec.metadata[ENV]
        for spec in dataclasses.fields(CleanupSettings)
        if not spec.metadata[ENVIRONMENT]
    }
    assert tuning and not tuning & set(asked)
    assert (chosen.release_mode, chosen.sweep_max_batches) == ("single", 3)


def test_the_name_scan_finds_every_kind_of_read(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "reads.py").write_text(
        "import os\n"
        "NAME = 'G'\n"
        "FILES = ('H', 'I')\n"
        "TABLE = {'q': 'J'}\n"
        "a = env_str('A')\n"
        "b = setting('B', 1, 'doc')\n"
        "c = os.environ.get('C')\n"
        "d = os.environ['D']\n"
        "e = os.getenv('E')\n"
        "f = 'F' in os.environ\n"
        "g = env_int(NAME)\n"
        "h = [env_str(name) for name in FILES]\n"
        "for _, name in TABLE.items():\n"
        "    env_bool(name)\n"
        "k = tuning('K', 1, 'doc')\n"
        "os.environ.setdefault('L', 'x')\n"
        "def reader(name):\n"
        "    return os.environ.get(name)\n"
    )
    found = env_names.reads(tmp_path)
    assert {read.name for read in found} == {*"ABCDEFGHIJL", None}
    assert {read.name for read in found if read.raw} == {"C", "D", "E", "F", None}


# --- the retention settings -------------------------------------------------------------------


def test_a_retention_in_hours_is_read_from_the_environment() -> None:
    out = run_with(
        "import django; django.setup(); from cleanup.conf import cleanup_settings as c; "
        "print(c().retention_days, c().dead_letter_retention_days)",
        CLEANUP_RETENTION_DAYS="0.25",
        CLEANUP_DEAD_LETTER_RETENTION_DAYS="0.5",
    )
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split()[-2:] == ["0.25", "0.5"]


def test_a_retention_shorter_than_the_lease_is_refused_naming_the_variables(settings: Any) -> None:
    # a receipt must outlive any message that may still arrive for it: a redelivery after the
    # visibility timeout, a re-published claim after the lease
    settings.CLEANUP_LEASE_SECONDS = 300
    settings.CLEANUP_RETENTION_DAYS = 0.003  # 259.2 s
    with pytest.raises(ImproperlyConfigured) as refused:
        cleanup_settings()
    assert str(refused.value).startswith(
        "CLEANUP_RETENTION_DAYS=0.003 (259.2 s) must exceed CLEANUP_LEASE_SECONDS"
    )
    settings.CLEANUP_RETENTION_DAYS = 0.004  # 345.6 s
    assert cleanup_settings().retention_days == 0.004


# --- the dead-letter settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "CLEANUP_DEAD_LETTER_RETENTION_DAYS=0.0 must be >= 0.001"),
        ("2w", "CLEANUP_DEAD_LETTER_RETENTION_DAYS='2w' is"),
    ],
)
def test_the_dead_letter_retention_is_checked_at_start_up_naming_the_variable(value, words):
    out = run_with("import django; django.setup()", CLEANUP_DEAD_LETTER_RETENTION_DAYS=value)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "CLEANUP_DEAD_LETTER_OPEN_CAP=0 must be >= 1"),
        ("lots", "CLEANUP_DEAD_LETTER_OPEN_CAP='lots' is not an integer"),
    ],
)
def test_the_open_letter_cap_is_checked_naming_the_setting(
    settings: Any, value: object, words: str
) -> None:
    # a tuning setting (cleanup.conf.tuning): a Django setting, not a variable
    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = value
    with pytest.raises(ImproperlyConfigured) as refused:
        cleanup_settings()
    assert str(refused.value).startswith(words)
