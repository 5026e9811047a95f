"""The test suite's phases as nox sessions: `nox -l` lists them, `nox -s NAME` runs one.

`bash scripts/test.sh` (the README's command; CI runs it with CI=true through .ci/run) makes
.venv, then runs the session `all`. Every session runs in that .venv, never in a virtualenv of
its own (`.venv/bin/nox -s unit`), on the PostgreSQL and Redis scripts/backing_servers.py finds
or starts; embedded servers started for the run are stopped when nox exits. With CI=true a
missing tool is installed with apt (as root), and one that cannot be had fails the run; in a
person's run it skips what needs it, and the end of the output lists what was left out.
docs/TESTING.md, "How the suite runs".
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))
import phases  # noqa: E402
from phases import in_ci, say  # noqa: E402

nox.needs_version = ">=2026.10.20"
nox.options.sessions = ["all"]
nox.options.default_venv_backend = "none"

BIN = ROOT / ".venv" / "bin"
PYTHON = str(BIN / "python")

# --- What runs where: a renamed test file changes one line here ------------------------------
#
# `all` runs three lanes at once, each pytest on a test database and broker space of its own,
# because most real-worker tests wait on workers rather than use the CPU:
#   lane 1: unit, then integration-a (the tests' Redis database and test database), [tls];
#   lane 2: integration-b (Redis database + 1, test database + _b), [pgbouncer] (+ _pgb),
#           [host-project] (+ _host);
#   lane 3: integration-c (Redis database + 2, + _c), [rabbitmq] (+ _amqp), [library-suites].
# [..] and the drills after the lanes run with CI=true or RESERVATIONS_DRILLS=1 (`nox -s full`).
UNIT = ["tests/unit"]
INTEGRATION = "tests/integration"
LANE_B = [  # the slow waiting real-worker modules (beat, autoscaler, metrics, try-it, planted)
    "tests/integration/test_beat.py",
    "tests/integration/test_beat_guard.py",
    "tests/integration/test_autoscale.py",
    "tests/integration/test_metrics.py",
    "tests/integration/test_try_it.py",
    "tests/integration/test_planted_state.py",
    "tests/integration/test_tracing_live.py",
]
LANE_C = [  # the browser tests, the failure-path modules, scenarios, the live web's own tests
    "tests/integration/browser",
    "tests/integration/test_hostile_input.py",
    "tests/integration/test_failure_paths_real.py",
    "tests/integration/test_health_commands.py",
    "tests/integration/test_task_failures.py",
    "tests/integration/test_pipeline_scenarios.py",
    "tests/integration/test_admin_lockout_live.py",
    "tests/integration/test_api_conformance.py",
    "tests/integration/test_api_client_example.py",
    "tests/integration/test_api_generated_client.py",
]
RABBITMQ_SUITES = [  # the real-worker correctness suites again on RabbitMQ
    "tests/integration/test_delivery.py",
    "tests/integration/test_pipeline_scenarios.py",
    "tests/integration/test_autoscale.py",
    "tests/integration/test_sweep_kill.py",
    "tests/integration/test_hostile_input.py",
    "tests/integration/test_tracing_live.py",
]
TLS_SUITES = [  # again on a TLS Redis (rediss://, how managed Redis runs)
    "tests/integration/test_delivery.py",
    "tests/integration/test_hostile_input.py",
]
PGBOUNCER_SUITES = [  # again behind PgBouncer in transaction pooling
    "tests/integration/test_delivery.py",
    "tests/integration/test_sweep_kill.py",
    "tests/integration/test_beat.py",
    "tests/integration/test_burst.py",
]
PRODSTACK_DRILL = "tests/integration/test_production_stack.py"
CHAOS_DRILL = "tests/integration/test_chaos.py"
SENTINEL_DRILL = "tests/integration/test_sentinel_failover.py"
PG_FAILOVER_DRILL = "tests/integration/test_postgres_failover.py"
RABBITMQ_CLUSTER_DRILL = "tests/integration/test_rabbitmq_cluster.py"
# The wheel built, installed and run in a project of its own: CPU-heavy for a minute (a venv,
# an install, three Celery processes), so CI's lane 2 runs it, not a person's run.
HOST_PROJECT = "tests/integration/test_host_project.py"
DRILL_FILES = [
    HOST_PROJECT,
    CHAOS_DRILL,
    PRODSTACK_DRILL,
    SENTINEL_DRILL,
    RABBITMQ_CLUSTER_DRILL,
    PG_FAILOVER_DRILL,
]

# The Debian packages some tests need, each with where it is found (commands, or path patterns).
# With CI=true (as root) the missing ones are installed with apt; a tool that still cannot be
# had fails the tests that need it (tests/support/missing_tools.py). Elsewhere those tests skip.
TOOLS = {
    "chromium": ("chromium", "chromium-browser"),  # the browser tests (never a downloaded one)
    "prometheus": ("prometheus",),  # the production-stack drill: these five in namespaces
    "prometheus-alertmanager": ("prometheus-alertmanager",),
    "redis-server": ("redis-server",),
    "docker-compose": ("docker-compose",),
    "postgresql": ("/usr/lib/postgresql/*/bin/postgres",),
    "iproute2": ("ip",),
    "iptables": ("iptables",),  # the chaos drills' partitions (docs/CHAOS.md)
    "openssl": ("openssl",),  # the TLS suites' certificates
    "pgbouncer": (
        "pgbouncer",
        "/usr/sbin/pgbouncer",
    ),  # tests/unit/reservations/test_pooling.py, pgbouncer
    "kubernetes-client": (
        "kubectl",
    ),  # the kustomize comparisons (tests/unit/project/test_deploy.py)
    "rabbitmq-server": ("rabbitmq-server", "/usr/sbin/rabbitmq-server"),  # unit and rabbitmq
}
LINT = {
    "ruff": ["ruff", "check", "."],
    "ruff-format": ["ruff", "format", "--check", "."],
    "mypy": ["mypy", "."],
}
# The unit tests' order: a new one each run, named in the phase (`unit (seed N)`).
SEED = random.randrange(2**32)
LEFT_OUT = phases.LeftOut()
_ready: set[str] = set()


def _interrupt(_signum: int, _frame: object) -> NoReturn:
    """SIGTERM ends the run as Ctrl-C at a terminal does: the running command is interrupted,
    nox stops, and the lanes and the embedded servers started here are stopped at exit."""
    phases.interrupt_children()
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _interrupt)


def present(*where: str) -> bool:
    return any(glob.glob(place) if "/" in place else shutil.which(place) for place in where)


def drills_wanted() -> bool:
    return in_ci() or os.environ.get("RESERVATIONS_DRILLS") == "1"


def prepare(session: nox.Session, services: bool = True) -> None:
    """.venv in step with requirements-dev.txt, and (``services``) DATABASE_URL and
    CELERY_BROKER_URL in the environment: once per nox, and the lanes' nox inherit them."""
    if os.environ.get("RESERVATIONS_VENV_READY") != str(ROOT):
        ensure = ". scripts/venv.sh && ensure_venv requirements-dev.txt"
        session.run("bash", "-c", ensure, log=False)
        os.environ["RESERVATIONS_VENV_READY"] = str(ROOT)
    LEFT_OUT.ensure()
    if not services or "services" in _ready:
        return
    _ready.add("services")
    command = [PYTHON, "scripts/backing_servers.py", "env", "--purpose", "test"]
    found = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if found.returncode != 0:
        session.error(f"scripts/backing_servers.py exited {found.returncode} (reason above)")
    exports = phases.parse_exports(found.stdout)
    started = exports.pop("RESERVATIONS_EMBEDDED_STARTED", "")
    os.environ.update(exports)
    if started:  # only those this nox started: never a shared one, nor one of `make run`'s
        atexit.register(stop_embedded, started)


def stop_embedded(started: str) -> None:
    say(f"==> stopping embedded servers: {started}")
    subprocess.run([PYTHON, "scripts/backing_servers.py", "stop", "--only", started], check=False)


def rabbitmq_server(session: nox.Session) -> None:
    """RabbitMQ up before the unit tests (scripts/rabbitmq.py starts it with CI=true when it is
    installed but stopped; without one a person's run lists the tests that needed it)."""
    if "rabbitmq" in _ready:
        return
    _ready.add("rabbitmq")
    found = subprocess.run([PYTHON, "scripts/rabbitmq.py"], stdout=subprocess.DEVNULL, check=False)
    if found.returncode not in (0, 3) or (found.returncode == 3 and in_ci()):
        session.error(f"scripts/rabbitmq.py exited {found.returncode} (reason above)")


def pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # A minute for pytest to stop its workers after Ctrl-C before nox terminates it.
    session.run(PYTHON, "-m", "pytest", *args, env=env or {}, interrupt_timeout=60)


def lane_broker(letter: str, offset: int) -> str:
    """RESERVATIONS_TEST_BROKER_URL_<LETTER> when given, else the tests' Redis database +
    ``offset`` (B: 13 -> 14, C: 13 -> 15); a broker that is not Redis is the broker itself."""
    url = os.environ["CELERY_BROKER_URL"]
    if not url.startswith("redis://"):
        return url
    given = os.environ.get(f"RESERVATIONS_TEST_BROKER_URL_{letter}")
    return given or phases.redis_database_plus(url, offset)


def own_database(suffix: str, broker: str | None = None) -> dict[str, str]:
    """A test database of its own (the main one's name + ``suffix``), and ``broker``."""
    env = {"DATABASE_URL": phases.with_database_suffix(os.environ["DATABASE_URL"], suffix)}
    return env | ({"CELERY_BROKER_URL": broker} if broker else {})


def cannot_have(session: nox.Session, what: str, left_out: str) -> None:
    """CI fails; a person's run says what it skipped and lists it at the end."""
    if in_ci():
        session.error(f"CI: {what} cannot be had here, and CI skips nothing: {left_out}")
    say(f"SKIPPED: {what} cannot be had here")
    LEFT_OUT.add(f"skipped because {what} is missing: {left_out}")


def have_or_install(session: nox.Session, found: bool, what: str, *packages: str) -> bool:
    """``found``, or in CI installed with apt now (CI fails when it cannot be)."""
    if found or not in_ci():
        return found
    if not phases.apt_install(*packages):
        session.error(f"CI: {what} could not be installed")
    return True


def on_private_server(
    session: nox.Session, script: str, suffix: str, what: str, label: str, suites: Sequence[str]
) -> None:
    """``script`` starts ``what`` in a temporary directory and prints the exports that reach it
    (exit 3: it cannot be had); pytest runs ``suites`` with them on a test database of their
    own (+ ``suffix``); then ``script`` stops it."""
    with tempfile.TemporaryDirectory() as where:
        found = subprocess.run([PYTHON, script, "start", where], stdout=subprocess.PIPE, text=True)
        if found.returncode == 3:
            return cannot_have(session, what, f"the {label} suites ({' '.join(suites)})")
        if found.returncode != 0:
            session.error(f"{script} exited {found.returncode}")
        env = own_database(suffix) | phases.parse_exports(found.stdout)
        if script == "scripts/pgbouncer.py":  # lane 2's broker: integration-b is done with it
            env["CELERY_BROKER_URL"] = lane_broker("B", 1)
        try:
            pytest(session, "-p", "no:cacheprovider", *suites, *session.posargs, env=env)
        finally:
            subprocess.run([PYTHON, script, "stop", where], check=False)


def drill(session: nox.Session, path: str, suffix: str, flag: str) -> None:
    """A failover or cluster drill: its own servers on free ports, a test database of its own
    (+ ``suffix``), and lane 3's Redis database (the lanes are done with it) for the test
    process's broker, or the broker itself when it is not Redis."""
    prepare(session)
    env = own_database(suffix, lane_broker("C", 2)) | {flag: "1"}
    pytest(session, "-p", "no:cacheprovider", "-s", path, *session.posargs, env=env)


# --- The phases, each a session ---------------------------------------------------------------


@nox.session(venv_backend="none")
def tools(session: nox.Session) -> None:
    """The programs some tests need: named when missing; with CI=true installed with apt."""
    prepare(session, services=False)
    missing = [package for package, where in TOOLS.items() if not present(*where)]
    if missing and not in_ci():
        say(f"not installed here: {' '.join(missing)} (the tests that need them will skip)")
    elif missing and not phases.apt_install(*missing):
        say(f"could not install {' '.join(missing)}: the tests that need them will fail")
    if in_ci():  # the partition drills run iptables inside a network namespace
        say(phases.iptables_in_namespace())


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff, ruff format --check and mypy."""
    prepare(session, services=False)
    for command in LINT.values():
        session.run(str(BIN / command[0]), *command[1:])


@nox.session(venv_backend="none")
def compose(session: nox.Session) -> None:
    """docker-compose.yml parses with .env.example as its .env (Debian's docker-compose)."""
    prepare(session, services=False)
    if not shutil.which("docker-compose"):
        return cannot_have(session, "docker-compose", "the compose validation (compose)")
    # A copy beside .env.example as its .env: an operator's own .env is neither needed nor read.
    with tempfile.TemporaryDirectory() as where:
        shutil.copy(ROOT / "docker-compose.yml", where)
        shutil.copy(ROOT / ".env.example", Path(where) / ".env")
        with session.chdir(where):
            session.run("docker-compose", "config", "-q")
    say("compose: valid")


@nox.session(venv_backend="none")
def unit(session: nox.Session) -> None:
    """tests/unit in a random order; -- --randomly-seed=N replays one."""
    prepare(session)
    rabbitmq_server(session)
    seed = next((arg.partition("=")[2] for arg in session.posargs if "-seed=" in arg), SEED)
    say(f"unit tests in a random order, seed {seed} (nox -s unit -- --randomly-seed={seed})")
    pytest(session, "-p", "randomly", f"--randomly-seed={seed}", *UNIT, *session.posargs)


@nox.session(name="integration-a", venv_backend="none")
def integration_a(session: nox.Session) -> None:
    """Lane 1's real-worker modules: those in no other lane, and no drill."""
    prepare(session)
    ignored = [f"--ignore={path}" for path in LANE_B + LANE_C + DRILL_FILES]
    pytest(session, INTEGRATION, *ignored, *session.posargs)


@nox.session(name="integration-b", venv_backend="none")
def integration_b(session: nox.Session) -> None:
    """Lane 2's real-worker modules (LANE_B): Redis database + 1, test database + _b."""
    prepare(session)
    env = own_database("_b", lane_broker("B", 1))
    pytest(session, "-p", "no:cacheprovider", *LANE_B, *session.posargs, env=env)


@nox.session(name="integration-c", venv_backend="none")
def integration_c(session: nox.Session) -> None:
    """Lane 3's real-worker modules (LANE_C): Redis database + 2, test database + _c."""
    prepare(session)
    env = own_database("_c", lane_broker("C", 2))
    pytest(session, "-p", "no:cacheprovider", *LANE_C, *session.posargs, env=env)


@nox.session(name="library-suites", venv_backend="none")
def library_suites(session: nox.Session) -> None:
    """kombu's and django-celery-beat's own tests against our subclasses."""
    prepare(session)
    session.run(PYTHON, "scripts/library_suites.py", *session.posargs)


@nox.session(venv_backend="none")
def rabbitmq(session: nox.Session) -> None:
    """The correctness suites again on RabbitMQ (the tests' own vhost), test database + _amqp."""
    prepare(session)
    given = bool(os.environ.get("RESERVATIONS_TEST_AMQP_URL"))
    found_server = given or present(*TOOLS["rabbitmq-server"])
    have_or_install(session, found_server, "rabbitmq-server", "rabbitmq-server")
    found = subprocess.run([PYTHON, "scripts/rabbitmq.py"], stdout=subprocess.PIPE, text=True)
    if found.returncode == 3:
        suites = f"the RabbitMQ suites ({' '.join(RABBITMQ_SUITES)})"
        return cannot_have(session, "RabbitMQ", suites)
    if found.returncode != 0:
        session.error(f"scripts/rabbitmq.py exited {found.returncode}")
    env = own_database("_amqp") | phases.parse_exports(found.stdout)
    pytest(session, "-p", "no:cacheprovider", *RABBITMQ_SUITES, *session.posargs, env=env)


@nox.session(venv_backend="none")
def tls(session: nox.Session) -> None:
    """The TLS suites on a private TLS-only Redis and a throwaway CA, test database + _tls."""
    prepare(session)
    what = "a TLS redis-server"
    on_private_server(session, "scripts/tls_redis.py", "_tls", what, "TLS", TLS_SUITES)


@nox.session(venv_backend="none")
def pgbouncer(session: nox.Session) -> None:
    """The PgBouncer suites behind a private pgbouncer in transaction pooling (+ _pgb)."""
    prepare(session)
    have_or_install(session, present(*TOOLS["pgbouncer"]), "pgbouncer", "pgbouncer")
    script = "scripts/pgbouncer.py"
    on_private_server(session, script, "_pgb", "pgbouncer", "PgBouncer", PGBOUNCER_SUITES)


@nox.session(venv_backend="none")
def prodstack(session: nox.Session) -> None:
    """The production-stack drill: docker-compose.yml's services in network namespaces."""
    prepare(session)
    env = own_database("_stack", os.environ["CELERY_BROKER_URL"])
    pytest(session, "-p", "no:cacheprovider", PRODSTACK_DRILL, *session.posargs, env=env)


@nox.session(venv_backend="none")
def chaos(session: nox.Session) -> None:
    """The chaos drills: a lost node, a restarted Redis, killed connections, a partition."""
    prepare(session)
    env = {"RESERVATIONS_CHAOS": "1"}
    pytest(session, "-p", "no:cacheprovider", "-s", CHAOS_DRILL, *session.posargs, env=env)


@nox.session(venv_backend="none")
def sentinel(session: nox.Session) -> None:
    """The Sentinel failover drill: its own master, replica and sentinels, the master killed."""
    packages = ("redis-server", "redis-sentinel")
    if have_or_install(session, present("redis-server"), "redis-server", *packages):
        drill(session, SENTINEL_DRILL, "_sentinel", "RESERVATIONS_SENTINEL_DRILL")
    else:
        cannot_have(session, "redis-server", f"the Sentinel failover drill ({SENTINEL_DRILL})")


@nox.session(name="host-project", venv_backend="none")
def host_project(session: nox.Session) -> None:
    """The wheel in a Django project of its own (CI and ``nox -s full``): lane 2's Redis
    database (integration-b and pgbouncer are done with it), test database + _host."""
    prepare(session)
    env = own_database("_host", lane_broker("B", 1)) | {"RESERVATIONS_HOST_PROJECT": "1"}
    pytest(session, "-p", "no:cacheprovider", HOST_PROJECT, *session.posargs, env=env)


@nox.session(name="pg-failover", venv_backend="none")
def pg_failover(session: nox.Session) -> None:
    """The PostgreSQL failover drill: its own primary and standby, the primary stopped hard."""
    found = present("/usr/lib/postgresql/*/bin/initdb")
    if have_or_install(session, found, "PostgreSQL's server binaries", "postgresql"):
        drill(session, PG_FAILOVER_DRILL, "_pgfo", "RESERVATIONS_PG_FAILOVER_DRILL")
    else:
        what = "PostgreSQL's server binaries"
        cannot_have(session, what, f"the PostgreSQL failover drill ({PG_FAILOVER_DRILL})")


@nox.session(name="rabbitmq-cluster", venv_backend="none")
def rabbitmq_cluster(session: nox.Session) -> None:
    """The RabbitMQ cluster drill: its own three nodes, the queue leader killed mid-drain."""
    found = os.access("/usr/lib/rabbitmq/bin/rabbitmq-server", os.X_OK)
    if have_or_install(session, found, "rabbitmq-server", "rabbitmq-server"):
        drill(session, RABBITMQ_CLUSTER_DRILL, "_rmqc", "RESERVATIONS_RABBITMQ_CLUSTER_DRILL")
    else:
        drill_ = f"the RabbitMQ cluster drill ({RABBITMQ_CLUSTER_DRILL})"
        cannot_have(session, "rabbitmq-server", drill_)


DRILLS = {
    "prodstack": prodstack,
    "chaos": chaos,
    "sentinel": sentinel,
    "pg-failover": pg_failover,
    "rabbitmq-cluster": rabbitmq_cluster,
}


@nox.session(venv_backend="none")
def drills(session: nox.Session) -> None:
    """Every drill, one after another: prodstack, chaos, sentinel, pg-failover, rabbitmq-cluster."""
    run = Run(session)
    for name, step in DRILLS.items():
        run.phase(name, functools.partial(step, session))
    run.report()


@nox.session(venv_backend="none")
def promtool(session: nox.Session) -> None:
    """The alert rules' tests (Debian's prometheus)."""
    prepare(session, services=False)
    if not shutil.which("promtool"):
        return cannot_have(session, "promtool", "the alert rule tests (promtool)")
    session.run("promtool", "check", "rules", "deploy/alerts.yml")
    session.run("promtool", "test", "rules", "deploy/alerts_test.yml")


@nox.session(name="pytest", venv_backend="none")
def pytest_args(session: nox.Session) -> None:
    """One pytest run of exactly the arguments after --."""
    if not session.posargs:
        session.error("pytest's arguments go after --: nox -s pytest -- tests/unit -x")
    prepare(session)
    pytest(session, *session.posargs)
    LEFT_OUT.add(
        "not run because pytest arguments were given: every phase but this pytest run (the",
        "real-worker lanes, the RabbitMQ, TLS Redis and PgBouncer phases, the library suites, the",
        "drills). What only they show: acks_late redelivery after a killed worker or pool child,",
        "confirmed publishing end to end on RabbitMQ (a refused batch, a dying quorum leader),",
        "session locks behind a real PgBouncer, the pause across a real fleet:",
        "bash scripts/test.sh",
    )


# --- Everything -------------------------------------------------------------------------------


NOX = [sys.executable, "-m", "nox", "--noxfile", str(ROOT / "noxfile.py")]


class Run:
    """Phases one after another, each announced and timed; a failing ``fatal`` one ends the run
    once the lanes beside it have finished (their output and failures are part of the report)."""

    def __init__(self, session: nox.Session) -> None:
        self.session = session
        self.timings = phases.Timings()
        self.lanes = phases.Lanes(self.timings, NOX)

    def phase(self, name: str, step: Callable[[], object], fatal: bool = True) -> bool:
        say(f"==> {name}")
        started = time.monotonic()
        failure = None
        try:
            step()
        except nox.command.CommandFailed as exc:
            failure = f"exit {exc.return_code}"
        except Exception as exc:  # noqa: BLE001 - session.error's, or a bug (with its traceback)
            if type(exc).__module__ != "nox.sessions":
                traceback.print_exc()
            failure = str(exc) or type(exc).__name__
        self.timings.add(name, time.monotonic() - started, failure)
        if phases.interrupted:  # a command that ended well after SIGTERM: still the end
            raise KeyboardInterrupt
        if failure and fatal:
            self.fail(f"{name} failed")
        return failure is None

    def fail(self, reason: str) -> NoReturn:
        self.lanes.finish_all()
        self.report()
        self.session.error(reason)

    def report(self) -> None:
        self.timings.report()
        LEFT_OUT.report()


@nox.session(name="all", venv_backend="none")
def all_phases(session: nox.Session) -> None:
    """Everything (bash scripts/test.sh); with -- ARGS the checks, then that one pytest run."""
    run = Run(session)
    run.phase("services", functools.partial(prepare, session))
    run.phase("tools", functools.partial(tools, session))
    run.phase("rabbitmq-server", functools.partial(rabbitmq_server, session))
    for name, command in LINT.items():
        run.phase(name, functools.partial(session.run, str(BIN / command[0]), *command[1:]))
    run.phase("compose", functools.partial(compose, session))
    if session.posargs:
        run.phase("pytest", functools.partial(pytest_args, session))
    else:
        lanes(session, run)
        if drills_wanted():
            for name, step in DRILLS.items():
                run.phase(name, functools.partial(step, session))
        else:
            LEFT_OUT.add(
                "not run in a person's run: the production-stack, chaos, Sentinel failover,",
                "PostgreSQL failover and RabbitMQ cluster drills, the TLS Redis, PgBouncer and",
                f"RabbitMQ phases and the library suites ({', '.join(DRILL_FILES)}; the TLS,",
                "PgBouncer and RabbitMQ suites; CI runs them): make test-full (nox -s full)",
            )
    run.phase("promtool", functools.partial(promtool, session))
    run.report()


def lanes(session: nox.Session, run: Run) -> None:
    """Lanes 2 and 3 beside lane 1; on a broker that is not Redis (no second broker database)
    the same phases one after another."""
    unit_name = f"unit (seed {SEED})"
    # CI adds TLS and PgBouncer (each on a private server of its own) to lanes 1 and 2 and
    # moves the library suites to lane 3, so that the three lanes take about as long.
    ci = drills_wanted()
    lane_1_tail = ["tls"] if ci else []
    # A person's run leaves the RabbitMQ re-run and the library suites to CI, to stay within
    # eight minutes.
    lane_2 = ["integration-b", *(["pgbouncer", "host-project"] if ci else [])]
    lane_3 = ["integration-c", *(["rabbitmq", "library-suites"] if ci else [])]
    if not os.environ["CELERY_BROKER_URL"].startswith("redis://"):
        say("the broker is not Redis: the pytest phases one after another")
        unit_ok = run.phase(unit_name, functools.partial(unit, session), fatal=False)
        for name in ["integration-a", *lane_2, *lane_3, *lane_1_tail]:
            run.phase(name, functools.partial(session.run, *NOX, "--sessions", name))
    else:
        run.lanes.start("lane-2", lane_2)
        run.lanes.start("lane-3", lane_3)
        # lane 1's second phase runs even when the first failed, as in the other lanes
        unit_ok = run.phase(unit_name, functools.partial(unit, session), fatal=False)
        run.phase("integration-a", functools.partial(integration_a, session))
        for name in lane_1_tail:
            run.phase(name, functools.partial(session.run, *NOX, "--sessions", name))
        if not run.lanes.finish_all():
            run.fail("a lane failed")
    if not unit_ok:
        run.fail("unit failed")


@nox.session(venv_backend="none")
def full(session: nox.Session) -> None:
    """`all` with the drills, the TLS and the PgBouncer phases, as CI runs it (make test-full)."""
    os.environ["RESERVATIONS_DRILLS"] = "1"
    all_phases(session)
