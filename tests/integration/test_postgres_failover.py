"""The PostgreSQL failover drill: a drain through real workers, two beats and the web on a
primary with a streaming standby, the primary stopped hard mid-drain and the standby promoted.

The test starts its own servers, on free ports and in private data directories (never the
machine's shared PostgreSQL): Debian's ``initdb`` makes a migrated template once, each case
copies it into a primary and ``pg_basebackup`` makes the standby. Workers, beats, gunicorn and
this process are given one multi-host ``DATABASE_URL`` (``primary,standby`` with
``target_session_attrs=read-write``), never told which host leads, and nobody is restarted.

Two modes. With synchronous replication (``synchronous_standby_names`` naming the standby)
no commit is acknowledged before the standby has it: nothing committed before the stop may be
missing after the promotion. With asynchronous replication the standby is cut off from the
primary first (its ``primary_conninfo`` pointed at a closed port, so it keeps what it received
and gets nothing more) while the primary goes on committing; what the standby never received
is lost, and the drill shows the claim lease brings every such hold back to a later sweep.
What the old primary had is read afterwards by starting its data directory alone on another
port, so the losses are counted exactly. The drill prints the recovery time (stop to the
first release through the promoted standby) and the losses; docs/TOPOLOGIES.md records them.

It runs only in its own phase (RESERVATIONS_PG_FAILOVER_DRILL=1: noxfile.py's session
``pg-failover``; alone: ``make pg-failover-drill``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from cleanup.release.schedule import BEAT_LOCK_APP_PREFIX, install_schedule
from config.env import parse_database_url
from tests.support.fleet import (
    ROOT,
    Beat,
    assert_each_released_once,
    beats,
    create_eligible_holds,
    drill_workers,
    free_port,
    log_lines,
    outcome_counts,
    service_env,
    sql,
    wait_until,
)
from tests.support.missing_tools import skip_for_missing
from tests.support.web import gunicorn

pytestmark = [
    pytest.mark.workers,
    pytest.mark.slow,
    pytest.mark.drill(
        env="RESERVATIONS_PG_FAILOVER_DRILL",
        reason="the PostgreSQL failover drill runs in its own phase: make pg-failover-drill",
    ),
]

HOLDS = 400
DATABASE = "drill"
# A drain the stop falls in the middle of: one message per hold, 20 holds per sweep, so the
# 2 shards' sweeps (beat, every second) release about 40 holds a second for 10 s. The lease is
# config.settings.test's: a hold whose release was lost comes back about 5 s after its claim.
DRAIN = {"CLEANUP_LEASE_SECONDS": "5"}
# The workers' tuning settings (Django settings, not variables).
DRAIN_SETTINGS = {
    "CLEANUP_RELEASE_MODE": "single",
    "CLEANUP_SWEEP_BATCH_SIZE": 20,
    "CLEANUP_SWEEP_MAX_BATCHES": 1,
}
# Seconds with no writable host between the stop and the promotion, as while a failover manager
# makes up its mind: sweeps, releases, dead letters, the beat's lease and the web's readiness
# all meet a database that refuses them.
OUTAGE_S = 3.0
# Asynchronous case: releases the primary commits after the standby was cut off, before the stop.
COMMITTED_WITHOUT_STANDBY = 15
# Ends the primary's WAL senders when a sweep's claims are committed and their releases not all
# yet: one statement, so that the releases still to come are the primary's alone.
CUT_MID_RELEASE = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_replication WHERE EXISTS (SELECT 1 FROM "
    "reservations_reservation WHERE status = 'held' AND claim_count > 0)"
)
# PostgreSQL refuses to run as root; as root its tools run as Debian's ``postgres`` user.
UNPRIVILEGED = "postgres"


def _bin_dir() -> Path:
    """Debian's newest PostgreSQL server binaries (``initdb`` is not on PATH there)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_major)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    skip_for_missing(
        "postgresql", "Debian's PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup)"
    )


def _major(path: str) -> int:
    version = Path(path).parts[-3]
    return int(version) if version.isdigit() else 0


def _run(tool: str, *args: str, timeout: float = 60) -> str:
    command = [str(_bin_dir() / tool), *args]
    if os.geteuid() == 0:
        command = ["runuser", "-u", UNPRIVILEGED, "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class Server:
    """One PostgreSQL server of the drill's own: a data directory and a port."""

    data: Path
    port: int = field(default_factory=free_port)

    @property
    def conninfo(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={DATABASE} connect_timeout=3"

    def configure(self, *lines: str) -> None:
        """Settings appended to postgresql.auto.conf (the last of a name wins)."""
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("\n".join(lines) + "\n")

    def start(self) -> None:
        self.configure(f"port = {self.port}")
        _run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-w", "start")

    def ctl(self, *args: str) -> str:
        return _run("pg_ctl", "-D", str(self.data), *args)

    def ask(self, query: str, params: list[Any] | None = None) -> Any:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            cur = conn.execute(query, params)
            row = cur.fetchone() if cur.description else None
            return row[0] if row else None

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


# Every server: TCP on 127.0.0.1 only, no socket file, replication allowed (initdb's pg_hba
# trusts 127.0.0.1 for it), and no fsync: the servers' files live as long as the test and no
# machine crash is simulated, so the OS page cache is as good as the disk (a stopped primary's
# WAL is still read back when it is started again).
BASE_SETTINGS = (
    "listen_addresses = '127.0.0.1'",
    "unix_socket_directories = ''",
    "wal_level = replica",
    "max_wal_senders = 4",
    "fsync = off",
    "full_page_writes = off",
)


@pytest.fixture(scope="module")
def template() -> Iterator[Path]:
    """A stopped, migrated data directory that each case copies: initdb and the migrations run
    once for the module."""
    root = Path(tempfile.mkdtemp(prefix="pg-failover-"))
    if os.geteuid() == 0:
        owner = pwd.getpwnam(UNPRIVILEGED)
        os.chown(root, owner.pw_uid, owner.pw_gid)
    try:
        server = Server(root / "template")
        _run("initdb", "-D", str(server.data), "-U", "postgres", "--auth=trust", "-N")
        server.configure(*BASE_SETTINGS)
        server.start()
        try:
            with psycopg.connect(
                f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres",
                autocommit=True,
            ) as conn:
                conn.execute(f"CREATE DATABASE {DATABASE}")
            migrated = subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                cwd=ROOT,
                env=service_env(DATABASE_URL=f"postgres://postgres@127.0.0.1:{server.port}/drill"),
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
            assert migrated.returncode == 0, migrated.stderr[-3000:]
        finally:
            server.ctl("-m", "fast", "-w", "stop")
        yield server.data
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Pair:
    """A primary and its streaming standby, processes of the test's own."""

    root: Path
    synchronous: bool
    primary: Server = field(init=False)
    standby: Server = field(init=False)

    def __post_init__(self) -> None:
        self.primary = Server(self.root / "primary")
        self.standby = Server(self.root / "standby")

    @property
    def url(self) -> str:
        return (
            f"postgres://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}/"
            f"{DATABASE}?target_session_attrs=read-write&connect_timeout=2"
        )

    def start(self, template: Path) -> Pair:
        # cp -a keeps the postgres user's ownership and the directory's 0700 mode
        subprocess.run(["cp", "-a", str(template), str(self.primary.data)], check=True)
        self.primary.start()
        _run(
            "pg_basebackup",
            "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.standby.data), "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        self._follow(self.primary.port)
        self.standby.start()
        wanted = "async"
        if self.synchronous:
            # Set only now: with no standby yet, every commit would wait for one. The standby
            # copied the primary's settings before this, so once promoted it waits for nobody.
            self.primary.ask("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
            self.primary.ask("SELECT pg_reload_conf()")
            wanted = "sync"
        wait_until(
            lambda: (
                self.primary.ask(
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = "
                    "'standby' AND state = 'streaming' AND sync_state = %s",
                    [wanted],
                )
                == 1
            ),
            timeout=30,
            what=f"the standby streaming ({wanted})",
        )
        return self

    def _follow(self, port: int) -> None:
        self.standby.configure(
            f"primary_conninfo = 'host=127.0.0.1 port={port} user=postgres "
            "application_name=standby connect_timeout=2'"
        )

    def cut_off_standby_mid_release(self) -> None:
        """The standby stops receiving while a sweep's releases are under way: the primary
        refuses it a new replication connection (pg_hba.conf), then, as soon as it holds claimed
        holds not yet released, ends its WAL sender in the same statement. The standby keeps
        those claims and gets none of the releases committed after them."""
        (self.primary.data / "pg_hba.conf").write_text(
            "host replication all 127.0.0.1/32 reject\nhost all all 127.0.0.1/32 trust\n"
        )
        self.primary.ask("SELECT pg_reload_conf()")
        with psycopg.connect(self.primary.conninfo, autocommit=True) as conn:
            wait_until(
                lambda: conn.execute(CUT_MID_RELEASE).fetchall(),
                timeout=15,
                interval=0.002,
                what="claimed holds not yet released, to cut the standby off then",
            )
        wait_until(
            lambda: self.primary.ask("SELECT count(*) FROM pg_stat_replication") == 0,
            timeout=15,
            interval=0.05,
            what="the standby cut off",
        )

    def stop_primary_hard(self) -> None:
        """``immediate``: every server process quits at once, no checkpoint, as in a crash."""
        self.primary.ctl("-m", "immediate", "-w", "stop")

    def promote(self) -> None:
        self.standby.ctl("-w", "promote")

    def old_primary_alone(self) -> Server:
        """The stopped primary's data directory started alone on a port of its own, outside the
        URL: what it had committed, read back after its crash recovery."""
        old = Server(self.primary.data)
        old.configure("synchronous_standby_names = ''")
        old.start()
        self.primary = old
        return old

    def stop(self) -> None:
        for server in (self.primary, self.standby):
            if server.running():
                try:
                    server.ctl("-m", "immediate", "-w", "stop")
                except RuntimeError:
                    pass


@contextmanager
def primary_and_standby(template: Path, synchronous: bool) -> Iterator[Pair]:
    root = template.parent / ("sync" if synchronous else "async")
    pair = Pair(root, synchronous)
    try:
        root.mkdir()
        if os.geteuid() == 0:
            shutil.chown(root, UNPRIVILEGED)
        yield pair.start(template)
    finally:
        pair.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def this_process_on(url: str) -> Iterator[None]:
    """This process's Django connection on the pair (as the web's and workers' are), and back
    on the test database afterwards."""
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(parse_database_url("DATABASE_URL", url))
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


@dataclass(frozen=True)
class Committed:
    """What one server holds of the drill's results: released holds, receipt and dead-letter
    ids, and each hold's claim count."""

    released: frozenset[int]
    receipts: frozenset[int]
    dead_letters: frozenset[int]
    claims: dict[int, int]

    @classmethod
    def on(cls, server: Server) -> Committed:
        with psycopg.connect(server.conninfo, autocommit=True) as conn:
            holds = conn.execute(
                "SELECT id, status, claim_count FROM reservations_reservation"
            ).fetchall()
            receipts = conn.execute("SELECT id FROM cleanup_cleanupreceipt").fetchall()
            letters = conn.execute("SELECT id FROM cleanup_deadletter").fetchall()
        return cls(
            frozenset(h for h, status, _ in holds if status == "released"),
            frozenset(r for (r,) in receipts),
            frozenset(d for (d,) in letters),
            {h: claims for h, _, claims in holds},
        )


def _released_through(url: str) -> int | None:
    """Released holds, read through the multi-host URL on a new connection (None while no host
    takes writes)."""
    try:
        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
            row = conn.execute(
                "SELECT count(*) FROM reservations_reservation WHERE status = 'released'"
            ).fetchone()
            return int(row[0]) if row else 0
    except psycopg.OperationalError:
        return None


def _ready(web: Any) -> bool:
    try:
        return bool(web.request("GET", "/readyz").status == 200)
    except OSError:
        return False


def _stamp(line: str) -> float:
    """The time of a text-format log line (config.logging.KeyValueFormatter: UTC, first)."""
    return datetime.fromisoformat(line.split(" ", 1)[0]).replace(tzinfo=UTC).timestamp()


def _sends(beat: Beat) -> list[float]:
    return [_stamp(line) for line in beat.lines("Sending due task cleanup: sweep shard ")]


def _sender_switches(two: list[Beat]) -> int:
    """How often the sender changes in the two beats' sends, merged in time order: 0 when one
    beat sent throughout, 1 for one handover, more when both sent in turns."""
    merged = sorted((t, i) for i, beat in enumerate(two) for t in _sends(beat))
    return sum(1 for (_, a), (_, b) in zip(merged, merged[1:], strict=False) if a != b)


def _lease_holders(server: Server) -> int:
    """Sessions of the server holding the beat lock (a beat's connection, by its name)."""
    return int(
        server.ask(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.granted AND a.application_name LIKE %s",
            [BEAT_LOCK_APP_PREFIX + "%"],
        )
    )


# What the workers logged about the failover, by what it interrupted.
LOGGED = {
    "release retried": "transient failure, retrying",
    "sweep lock let go with its connection": "sweep lock not released",
    "dead-lettered": "dead-lettered",
    "dead letter not stored": "dead letter could not be stored",
    "message sent again": "dead letter not stored: message sent again",
}
OPEN_PERIODIC_LETTERS = (
    "SELECT id FROM cleanup_deadletter WHERE reason = 'periodic_failed' AND resolved_at IS NULL"
)


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "asynchronous"])
def test_a_primary_stopped_mid_drain_is_followed_to_the_promoted_standby_each_hold_released_once(
    tmp_path: Path, template: Path, synchronous: bool
) -> None:
    # given: a primary and a streaming standby of the test's own; two workers, two beats (1 s
    # sweeps of 2 shards) and gunicorn told only the multi-host URL; 400 expired holds
    with primary_and_standby(template, synchronous) as pair, this_process_on(pair.url):
        ids = create_eligible_holds(HOLDS, offerings=6)
        install_schedule(shards=2, every=1)
        env = {"DATABASE_URL": pair.url, **DRAIN}
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        with drill_workers(tmp_path, "pg", env, django_settings=DRAIN_SETTINGS) as workers:
            with (
                beats(tmp_path, 2, env_overrides=env) as two,
                gunicorn(tmp_path, workers=1, threads=2, **env) as web,
            ):
                started_at = time.time()
                wait_until(
                    lambda: (_released_through(pair.url) or 0) >= HOLDS // 5,
                    timeout=60,
                    interval=0.1,
                    what="the drain under way",
                )
                assert _ready(web)
                assert _lease_holders(pair.primary) == 1
                if not synchronous:
                    # Asynchronous replication, made visible on one machine: the standby is
                    # cut off mid-release, and the stop comes once the primary committed more
                    # releases alone.
                    pair.cut_off_standby_mid_release()
                    cut = Committed.on(pair.primary)
                    wait_until(
                        lambda: (
                            len(Committed.on(pair.primary).released - cut.released)
                            >= COMMITTED_WITHOUT_STANDBY
                        ),
                        timeout=10,
                        interval=0.05,
                        what="releases committed without the standby",
                    )
                # when: the primary is stopped hard mid-drain (what it had committed read
                # just before) and the standby promoted
                before_stop = Committed.on(pair.primary)
                pair.stop_primary_hard()
                stopped_at = time.time()
                # no host takes writes for a while: the web says it is not ready (at once,
                # not after a hang), and nobody is restarted
                time.sleep(OUTAGE_S / 2)
                ready_in_outage = _ready(web)
                time.sleep(max(0.0, stopped_at + OUTAGE_S - time.time()))
                at_promotion = Committed.on(pair.standby)
                pair.promote()
                promoted_at = time.time()
                connection.close()  # this process's handle on the lost primary
                # then: every hold is released, through the promoted standby
                wait_until(
                    lambda: _released_through(pair.url) == HOLDS,
                    timeout=90,
                    interval=0.25,
                    what="every hold released after the failover",
                )
                finished_at = time.time()
                # web serves again, and one beat holds the lease on the new primary
                wait_until(lambda: _ready(web), timeout=30, what="gunicorn's /readyz again")
                # a sweep the stop interrupted left a periodic_failed letter; the next sweep of
                # its shard settles it (docs/PIPELINE.md)
                wait_until(
                    lambda: not sql(OPEN_PERIODIC_LETTERS),
                    timeout=30,
                    what="the interrupted sweeps' letters settled by the next sweeps",
                )
                wait_until(
                    lambda: _lease_holders(pair.standby) == 1,
                    timeout=30,
                    what="a beat's lease on the promoted standby",
                )
                beats_alive = [b.alive() for b in two]
                sends = [_sends(b) for b in two]
                acquired = [len(b.lines("beat lock acquired")) for b in two]
                lease_failures = [b.lines("beat cannot take its lock") for b in two]
                switches = _sender_switches(two)
            alive = [w.alive() for w in workers]
        old = Committed.on(pair.old_primary_alone())
        times = [
            float(t)
            for (t,) in sql(
                "SELECT extract(epoch FROM released_at) FROM reservations_reservation "
                "WHERE status = 'released' ORDER BY released_at"
            )
        ]
        first_after = next((t for t in times if t > promoted_at), None)
        gap = max(b - a for a, b in zip(times, times[1:], strict=False))
        lost = sorted(old.released - at_promotion.released)
        unacknowledged = sorted(old.released - before_stop.released)
        final_claims = dict(
            sql("SELECT id, claim_count FROM reservations_reservation WHERE id = ANY(%s)", [lost])
        )
        # a lost release whose claim reached the standby waits there for the claim's lease to
        # pass (the others are due at once); taken again by a sweep, its claim count goes up
        lease_bound = [h for h in lost if at_promotion.claims[h] >= 1]
        leased_back = [h for h in lease_bound if final_claims[h] > at_promotion.claims[h]]
        lease_late = max(
            (
                float(t) - stopped_at
                for (t,) in sql(
                    "SELECT extract(epoch FROM released_at) FROM reservations_reservation "
                    "WHERE id = ANY(%s)",
                    [lease_bound],
                )
            ),
            default=0.0,
        )
        sends_after = [sum(1 for t in s if t > promoted_at) for s in sends]
        logged = {what: len(log_lines(logs, needle)) for what, needle in LOGGED.items()}
        letters = dict(
            sql(
                "SELECT reason || ':' || coalesce(nullif(resolution, ''), 'open'), count(*) "
                "FROM cleanup_deadletter GROUP BY 1"
            )
        )
        lease_errors = [len(b) for b in lease_failures]
        print(  # the measurements, shown with -s (docs/TOPOLOGIES.md records them)
            f"\npostgres failover ({'synchronous' if synchronous else 'asynchronous'}): "
            f"{len(before_stop.released)}/{HOLDS} released on the primary just before the stop,"
            f" {len(old.released)} in its files after it; the promoted standby started from "
            f"{len(at_promotion.released)} released, {len(at_promotion.receipts)}/"
            f"{len(old.receipts)} receipts, {len(at_promotion.dead_letters)}/"
            f"{len(old.dead_letters)} dead letters; lost: {len(lost)} releases "
            f"({len(unacknowledged)} committed on the old primary after the last read; "
            f"{len(lease_bound)} claimed on the standby, {len(leased_back)} of them re-claimed "
            f"after the lease, the last released +{lease_late:.1f}s after the stop), "
            f"{len(old.receipts - at_promotion.receipts)} receipts, "
            f"{len(old.dead_letters - at_promotion.dead_letters)} dead letters; "
            f"promoted +{promoted_at - stopped_at:.1f}s after the stop; first release through "
            f"the promoted standby +{(first_after or 0) - stopped_at:.1f}s "
            f"(+{(first_after or 0) - promoted_at:.1f}s after the promotion); all released "
            f"+{finished_at - stopped_at:.1f}s (the drain {max(times) - started_at:.1f}s in "
            f"all); the longest stretch without a release {gap:.1f}s; beat sends "
            f"{[len(s) for s in sends]} ({sends_after} after the promotion), leases acquired "
            f"{acquired}, sender switches {switches}, lease errors logged {lease_errors}; /readyz "
            f"in the outage {'ready' if ready_in_outage else 'not ready'}; workers logged "
            f"{logged}; dead letters at the end {letters}; outcomes {outcome_counts()}"
        )
        # every hold released exactly once, seats conserved, none left held
        assert_each_released_once(ids)
    assert first_after is not None
    if synchronous:
        # nothing acknowledged before the stop is missing after the promotion
        assert before_stop.released <= at_promotion.released
        assert before_stop.receipts <= at_promotion.receipts
        assert before_stop.dead_letters <= at_promotion.dead_letters
    else:
        # the releases the standby never received are gone with the primary, and a later sweep
        # claimed each of those holds again and released it: at once when its claim never
        # reached the standby either, after the claim's lease when it did. How many claims the
        # standby received before the stop is the replication lag's to decide; the line above
        # says how many took the lease path in this run.
        assert len(lost) >= COMMITTED_WITHOUT_STANDBY, lost
        assert all(final_claims[h] > at_promotion.claims[h] for h in lost), {
            h: (at_promotion.claims[h], final_claims[h]) for h in lost
        }
        assert leased_back == lease_bound, (lease_bound, final_claims)
    # nobody was restarted: the workers, beats and gunicorn started before the stop are up;
    # a beat took the lease on the promoted standby and sent, and the two beats never sent
    # in turns (one sender throughout, or one handover)
    assert all(alive), alive
    assert all(beats_alive), beats_alive
    assert not ready_in_outage
    assert sum(sends_after) > 0, sends
    assert switches <= 1, sends
