"""The soak drill: steady traffic on the whole system for ``--minutes``, watching what grows.

    .venv/bin/python bench/soak.py --minutes 60 --out DIR [--rate 4] [--burst-every 300]
        [--burst-holds 2000] [--sample-every 10] [--database NAME] [--broker URL]

Creates (or empties) the private database ``reservations_drill`` and Redis DB 6 (or
``--database`` and ``--broker``), migrates, and
starts what docker-compose.yml runs: gunicorn (2 processes × 2 threads), two ``celery worker``
× 2 processes, ``celery beat`` (the schedule installed with sweeps every 2 s) and Flower
(read-only, persistent, as compose runs it). Then, for ``--minutes``:

- **arrivals** through the JSON API (an API client's token, so the rate limiter counts): about
  ``--rate`` holds a second on 16 offerings, each with an ``Idempotency-Key`` and a TTL of 5–30 s;
  of them 15 % are renewed once, 15 % confirmed and 10 % cancelled before they expire, the rest
  expire and are released by the pipeline;
- **a burst** every ``--burst-every`` seconds, the first at half that: ``--burst-holds`` holds
  through the API as fast as one client sends them, expiring within 10-30 s;
- **the retention jobs on short settings**: receipts, outbox events and resolved dead letters
  kept ``retention`` (a sixth of the run, 2–10 minutes), idempotency keys as long, the prune
  every 30 s, the lease 90 s (the retention must exceed it); the drill stands in for the events'
  consumer and empties the events queue at every sample.

Every ``--sample-every`` seconds it records each process's resident memory (the processes'
``/proc`` status, children included), the rows of every table of the apps and of
django-celery-beat (``count(*)``), the keys of Redis DB 6 (``DBSIZE``) and the lengths of its
lists, and the oldest eligible hold (``reservations.services.eligible_backlog``, as the gauges
read it). After the traffic stops, the pipeline has 120 s to drain (``finished``, the burst
drill's check); the invariants are the burst drill's (``tools.drills.invariants``) over the holds
released within the retention.

Writes ``DIR/report.json`` (``minutes``, ``holds``, ``finished``, ``invariants``,
``peak_oldest_eligible_s``, ``processes``, ``tables``, ``redis_keys``, ``growth``, ``grew`` and
the samples) and ``DIR/plot.png``; the thresholds of "grew" are in ``bench/soak_analysis.py``.
Prints one line a minute. The drill's own work is a few HTTP requests and SQL counts a second.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, not the project
    sys.path.insert(0, str(ROOT))

from bench.arms import events, settings_env  # noqa: E402
from bench.flash_sale import BROKER, DRILL_DB, PG_SERVER  # noqa: E402  (the drills' defaults)

OFFERINGS = 16
SWEEP_EVERY = 2
PRUNE_EVERY = 30
LEASE_SECONDS = 90
DRAIN_TIMEOUT_S = 120
FLOWER_AUTH = "soak:soak-only"
# What becomes of a hold made through the API, by share (the rest expire and are released).
FATES = (("renew", 0.15), ("confirm", 0.15), ("cancel", 0.10))


def retention_seconds(minutes: float) -> int:
    """A sixth of the run, between 2 and 10 minutes: long enough to outlast the lease, short
    enough that every retained table has stopped growing well before the second half."""
    return int(min(600, max(120, minutes * 60 / 6)))


def soak_settings(minutes: float) -> dict[str, object]:
    """The Django settings of every process of the drill (bench/arms.py): task events on, as
    deployed (Flower shows nothing without them), and the short retention."""
    kept = retention_seconds(minutes)
    return events(True) | {
        "CLEANUP_RETENTION_DAYS": kept / 86400,
        "CLEANUP_DEAD_LETTER_RETENTION_DAYS": kept / 86400,
        "CLEANUP_LEASE_SECONDS": LEASE_SECONDS,
        "RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS": kept,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the processes -------------------------------------------------------------------------


@dataclass
class Service:
    """One process the drill started (its own session), and the log it writes."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(found)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 2)
    except OSError:
        return None
    return None


def process_rss(services: list[Service]) -> dict[str, float]:
    """Resident MiB of each service's main process and each of its children, by a stable name
    (``worker0``, ``worker0/child1``, …), and of the drill itself."""
    out: dict[str, float] = {}
    for service in services:
        if not service.alive():
            continue
        for label, pid in [(service.name, service.pid)] + [
            (f"{service.name}/child{i + 1}", child) for i, child in enumerate(children(service.pid))
        ]:
            mib = rss_mib(pid)
            if mib is not None:
                out[label] = mib
    drill = rss_mib(os.getpid())
    if drill is not None:
        out["soak-drill"] = drill
    return out


def wait_for(what: str, ready: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready in {timeout:.0f} s")


def http_up(port: int, path: str) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        ok = conn.getresponse().status < 500
        conn.close()
        return ok
    except OSError:
        return False


def start_services(out: Path, env: dict[str, str]) -> tuple[list[Service], int, int]:
    python, celery = sys.executable, str(Path(sys.executable).with_name("celery"))
    web_port, flower_port = free_port(), free_port()
    stamp = datetime.now(UTC).strftime("%H%M%S")
    web = Service(
        "web",
        [
            python,
            "-m",
            "gunicorn",
            "config.wsgi:application",
            f"--bind=127.0.0.1:{web_port}",
            "--workers=2",
            "--threads=2",
            "--worker-class=gthread",
            "--timeout=30",
        ],
        out / "web.log",
        env,
    )
    workers = [
        Service(
            f"worker{i}",
            [
                celery,
                "-A",
                "config",
                "worker",
                "-c",
                "2",
                "-n",
                f"soak{i}-{stamp}@%h",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=INFO",
            ],
            out / f"worker{i}.log",
            env,
        )
        for i in range(2)
    ]
    beat = Service(
        "beat",
        [
            celery,
            "-A",
            "config",
            "beat",
            "--loglevel=INFO",
            f"--schedule={out / 'celerybeat-schedule'}",
        ],
        out / "beat.log",
        env,
    )
    flower = Service(
        "flower",
        [
            celery,
            "-A",
            "config",
            "flower",
            "--address=127.0.0.1",
            f"--port={flower_port}",
            "--read_only=True",
            "--persistent=True",
            f"--db={out / 'flower.db'}",
            "--purge_offline_workers=600",
            "--max_tasks=10000",
        ],
        out / "flower.log",
        {**env, "FLOWER_BASIC_AUTH": FLOWER_AUTH},
    )
    services = [web, *workers, beat, flower]
    for service in services:
        service.start()
    for worker in workers:
        wait_for(f"{worker.name}", lambda w=worker: " ready." in w.log_text() or not w.alive())
    wait_for("gunicorn", lambda: http_up(web_port, "/healthz") or not web.alive())
    wait_for("flower", lambda: http_up(flower_port, "/healthcheck") or not flower.alive())
    dead = [s.name for s in services if not s.alive()]
    if dead:
        raise RuntimeError(f"exited at start: {', '.join(dead)} (logs in {out})")
    return services, web_port, flower_port


# --- the traffic ---------------------------------------------------------------------------


@dataclass(order=True)
class Due:
    at: float
    action: str = field(compare=False)
    hold: int = field(compare=False)
    version: int = field(compare=False)


@dataclass
class Traffic:
    """Arrivals through the API, and what becomes of each hold."""

    port: int
    token: str
    offerings: list[int]
    rng: random.Random
    conn: http.client.HTTPConnection | None = None
    due: list[Due] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    sent: int = 0

    def request(self, path: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Content-Type": "application/json",
            "Idempotency-Key": key,
        }
        for attempt in (1, 2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                self.conn.request("POST", f"/api/v1/{path}", json.dumps(body), headers)
                response = self.conn.getresponse()
                raw = response.read()
                return response.status, json.loads(raw) if raw else {}
            except (OSError, http.client.HTTPException):
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def arrive(self, now: float) -> None:
        ttl = self.rng.randint(5, 30)
        offering = self.rng.choice(self.offerings)
        self.sent += 1
        status, body = self.request(
            f"offerings/{offering}/holds",
            {"holder": f"soak-{self.sent}", "ttl_seconds": ttl},
            f"soak-hold-{self.sent}",
        )
        self.count(f"hold {status}")
        if status != 201:
            return
        pick, edge = self.rng.random(), 0.0
        for fate, share in FATES:
            edge += share
            if pick < edge:
                # before it expires: somewhere in the first 80 % of its TTL
                at = now + self.rng.uniform(0.5, ttl * 0.8)
                heapq.heappush(self.due, Due(at, fate, int(body["id"]), int(body["version"])))
                return

    def burst(self, holds: int, number: int) -> int:
        """``holds`` holds as fast as one client sends them (a flash sale), expiring within
        10-30 s; each is then left to expire. Returns how many were taken."""
        taken = 0
        for i in range(holds):
            status, _ = self.request(
                f"offerings/{self.offerings[i % len(self.offerings)]}/holds",
                {"holder": f"soak-burst-{number}-{i}", "ttl_seconds": 10 + i * 20 // holds},
                f"soak-burst-{number}-{i}",
            )
            self.count(f"burst hold {status}")
            taken += status == 201
        return taken

    def act(self, now: float) -> None:
        while self.due and self.due[0].at <= now:
            due = heapq.heappop(self.due)
            body: dict[str, Any] = {"expected_version": due.version}
            if due.action == "renew":
                body["ttl_seconds"] = self.rng.randint(5, 30)
            status, _ = self.request(
                f"holds/{due.hold}/{due.action}", body, f"soak-{due.action}-{due.hold}"
            )
            self.count(f"{due.action} {status}")


# --- the samples ---------------------------------------------------------------------------


def growing_tables() -> list[str]:
    """Every table of the apps and of django-celery-beat (whatever can grow with traffic)."""
    from django.db import connection

    prefixes = ("cleanup_", "reservations_", "django_celery_beat_")
    return sorted(t for t in connection.introspection.table_names() if t.startswith(prefixes))


def table_rows(tables: list[str]) -> dict[str, int]:
    from reservations.db import scalar

    return {table: int(scalar(f'SELECT count(*) FROM "{table}"')) for table in tables}


def oldest_eligible() -> tuple[float, int]:
    from cleanup.conf import cleanup_settings
    from reservations.models import BUCKETS
    from reservations.services import eligible_backlog

    backlog = eligible_backlog(range(BUCKETS), cleanup_settings().eligible_count_cap)
    return round(backlog.oldest_age_seconds, 2), backlog.eligible


def redis_reading(client: Any) -> dict[str, int]:
    """Keys of the drill's DB (all, and those without a TTL), and the lengths of the lists and
    the hash that hold messages."""
    from cleanup.conf import cleanup_settings

    conf = cleanup_settings()
    pipe = client.pipeline()
    pipe.dbsize()
    pipe.llen(conf.release_queue)
    pipe.llen(conf.sweep_queue)
    pipe.llen(conf.maintenance_queue)
    pipe.llen(conf.events_queue)
    pipe.hlen("unacked")
    keys, release, sweep, maintenance, events_, unacked = pipe.execute()
    ttls = redis_key_names(client, limit=1000)
    return {
        "keys": int(keys),
        # keys that expire (the attempt tally's, one a minute for two hours) are bounded by
        # their TTL; a key without one is bounded by nothing but what removes it
        "keys_without_ttl": sum(1 for ttl in ttls.values() if ttl < 0),
        "release_queue": int(release),
        "sweep_queue": int(sweep),
        "maintenance_queue": int(maintenance),
        "events_queue": int(events_),
        "unacked": int(unacked),
    }


def redis_key_names(client: Any, limit: int = 200) -> dict[str, int]:
    """The drill DB's keys (at most ``limit``) and their TTLs in seconds (-1: none)."""
    pipe = client.pipeline()
    names = [key for _, key in zip(range(limit), client.scan_iter(count=100), strict=False)]
    for key in names:
        pipe.ttl(key)
    return {
        name.decode(errors="replace"): int(ttl)
        for name, ttl in sorted(zip(names, pipe.execute(), strict=True))
    }


def flower_tasks_seen(port: int) -> int | None:
    """Tasks Flower has been told of (its ``flower_events_total`` of type task-received):
    what its task memory holds, up to its ``--max_tasks``."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        auth = base64.b64encode(FLOWER_AUTH.encode()).decode()
        conn.request("GET", "/metrics", headers={"Authorization": f"Basic {auth}"})
        text = conn.getresponse().read().decode(errors="replace")
        conn.close()
    except (OSError, http.client.HTTPException):
        return None
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("flower_events_total{") and 'type="task-received"' in line
        )
    )


def consume_events(client: Any) -> int:
    """Stand in for the events' consumer: take what the relay published."""
    from cleanup.conf import cleanup_settings

    queue = cleanup_settings().events_queue
    taken = 0
    while True:
        got = client.lpop(queue, 1000)
        if not got:
            return taken
        taken += len(got)


# --- the run -------------------------------------------------------------------------------


def prepare(env: dict[str, str], database: str, broker: str) -> None:
    import psycopg
    import redis

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{database}"')
    redis.Redis.from_url(broker).flushdb()  # the drill's own DB number only
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    subprocess.run(
        [
            *manage,
            "install_cleanup_schedule",
            "--force",
            "--shards",
            "4",
            "--every",
            str(SWEEP_EVERY),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def setup_data() -> tuple[list[int], str]:
    """The offerings, an API client with a token, and the prune every ``PRUNE_EVERY`` s (an
    operator's edit of its beat entry, as the admin makes it)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from cleanup.release.schedule import PRUNE_NAME
    from reservations import clients, services
    from reservations.models import ApiClient

    offerings = [services.create_offering(f"soak-{i}", 1_000_000).pk for i in range(OFFERINGS)]
    client = ApiClient.objects.create(
        name="soak", can_write=True, all_offerings=True, requests_per_minute=100_000
    )
    token = clients.issue_token(client)
    every, _ = IntervalSchedule.objects.get_or_create(
        every=PRUNE_EVERY, period=IntervalSchedule.SECONDS
    )
    PeriodicTask.objects.filter(name=PRUNE_NAME).update(interval=every)
    return offerings, token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=4.0, help="API holds per second")
    parser.add_argument("--burst-every", type=float, default=300.0, help="seconds")
    parser.add_argument("--burst-holds", type=int, default=2000)
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--database", default=DRILL_DB, help="the drill's database, dropped and created first"
    )
    parser.add_argument(
        "--broker", default=BROKER, help="the drill's Redis database, emptied first"
    )
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        SECRET_KEY=env.get("SECRET_KEY", "drill-only"),
        RESERVATIONS_API_TOKEN=env.get("RESERVATIONS_API_TOKEN", "drill-only"),
        DATABASE_URL=f"{PG_SERVER}/{args.database}",
        CELERY_BROKER_URL=args.broker,
        WORKER_METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    env.update(settings_env(soak_settings(args.minutes)))
    os.environ.update(env)
    prepare(env, args.database, args.broker)
    import django

    django.setup()
    offerings, token = setup_data()
    services, web_port, flower_port = start_services(out, env)
    try:
        report = run(args, out, services, (web_port, flower_port), offerings, token)
    finally:
        for service in reversed(services):
            service.stop()
    write(out, report)
    print(
        f"soak: {report['minutes']} min, {report['holds']} holds, finished {report['finished']}, "
        f"invariants {'OK' if report['invariants']['ok'] else report['invariants']['violations']}, "
        f"peak oldest eligible {report['peak_oldest_eligible_s']} s, "
        f"grew: {', '.join(report['grew']) or 'nothing'}\nwritten {out}/report.json, plot.png"
    )
    ok = report["finished"] and report["invariants"]["ok"]
    return 0 if ok else 1


def run(
    args: argparse.Namespace,
    out: Path,
    services: list[Service],
    ports: tuple[int, int],
    offerings: list[int],
    token: str,
) -> dict[str, Any]:
    import redis

    from reservations.db import scalar
    from tools.drills.burst import caught_up

    client = redis.Redis.from_url(args.broker)
    tables = growing_tables()
    web_port, flower_port = ports
    traffic = Traffic(web_port, token, offerings, random.Random(args.seed))
    duration = args.minutes * 60
    samples: list[dict[str, Any]] = []
    bursts: list[dict[str, float]] = []
    seeded = 0
    consumed = 0
    key_names: dict[str, dict[str, int]] = {}
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    next_arrival = next_sample = next_burst = 0.0
    next_burst = args.burst_every / 2
    last_line = 0.0
    tick = 0.05

    def take_sample(t: float, phase: str) -> dict[str, Any]:
        nonlocal consumed
        consumed += consume_events(client)
        age, eligible = oldest_eligible()
        sample = {
            "t": round(t, 1),
            "phase": phase,
            "oldest_eligible_s": age,
            "eligible": eligible,
            "rss_mib": process_rss(services),
            "rows": table_rows(tables),
            "redis": redis_reading(client),
            "flower_tasks_seen": flower_tasks_seen(flower_port),
            "services_alive": [s.name for s in services if s.alive()],
        }
        samples.append(sample)
        return sample

    while True:
        t = time.monotonic() - t0
        if t >= duration:
            break
        if t >= next_arrival:
            traffic.arrive(t)
            next_arrival += traffic.rng.expovariate(args.rate)
        traffic.act(t)
        if t >= next_burst:
            seeded += traffic.burst(args.burst_holds, len(bursts) + 1)
            bursts.append({"t": round(t, 1), "holds": args.burst_holds})
            next_burst += args.burst_every
        if t >= next_sample:
            sample = take_sample(t, "traffic")
            if "half" not in key_names and t >= duration / 2:
                key_names["half"] = redis_key_names(client)
            next_sample += args.sample_every
            if t - last_line >= 60 or not last_line:
                last_line = t or 1e-9
                print(
                    f"[{time.strftime('%H:%M:%S')}] t={t / 60:5.1f} min  holds "
                    f"{traffic.sent + seeded:,}  oldest eligible {sample['oldest_eligible_s']} s  "
                    f"receipts {sample['rows'].get('cleanup_cleanupreceipt', 0):,}  "
                    f"redis keys {sample['redis']['keys']}  alive "
                    f"{len(sample['services_alive'])}/{len(services)}",
                    flush=True,
                )
        wait = min(next_arrival, next_sample, next_burst, traffic.due[0].at if traffic.due else 1e9)
        time.sleep(max(0.0, min(tick * 4, wait - (time.monotonic() - t0))))
    end = time.monotonic() - t0
    key_names["end"] = redis_key_names(client)
    # The traffic stops; the pipeline drains what is due (the last holds expire within 30 s).
    finished = False
    drain_deadline = end + 30 + DRAIN_TIMEOUT_S
    while time.monotonic() - t0 < drain_deadline:
        t = time.monotonic() - t0
        traffic.act(t)
        sample = take_sample(t, "drain")
        held = int(scalar("SELECT count(*) FROM reservations_reservation WHERE status = 'held'"))
        if (
            not traffic.due
            and held == 0
            and caught_up(sample["eligible"], sample["redis"]["release_queue"])
        ):
            finished = True
            break
        time.sleep(min(args.sample_every, 5))
    from tools.drills.invariants import invariant_violations

    # The holds released within the retention still have their events (less a minute of margin).
    kept = retention_seconds(args.minutes)
    since = datetime.now(UTC) - timedelta(seconds=kept - 60)
    violations = invariant_violations(released_since=since)
    if not finished:
        violations.insert(0, f"did not drain within {DRAIN_TIMEOUT_S} s after the traffic")
    crashed = [s.name for s in services if not s.alive()]
    if crashed:
        violations.append(f"processes exited during the run: {', '.join(crashed)}")
    holds_total = int(scalar("SELECT count(*) FROM reservations_reservation"))
    return build_report(
        args,
        samples,
        end,
        finished,
        violations,
        traffic,
        bursts,
        seeded,
        consumed,
        holds_total,
        started_at,
        kept,
        key_names,
    )


def series(
    samples: list[dict[str, Any]], pick: Any, phase: str = "traffic"
) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(t, value)]}`` from each sample's mapping ``pick(sample)``."""
    named: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        if sample["phase"] != phase:
            continue
        for name, value in pick(sample).items():
            named.setdefault(name, []).append((sample["t"], float(value)))
    return named


def build_report(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    end: float,
    finished: bool,
    violations: list[str],
    traffic: Traffic,
    bursts: list[dict[str, float]],
    seeded: int,
    consumed: int,
    holds_total: int,
    started_at: datetime,
    kept: int,
    key_names: dict[str, dict[str, int]],
) -> dict[str, Any]:
    from bench import soak_analysis as analysis

    rss = series(samples, lambda s: s["rss_mib"])
    rows = series(samples, lambda s: s["rows"])
    redis_ = series(samples, lambda s: s["redis"])
    kinds = {
        "rss_mib": (analysis.RSS, rss),
        "rows": (analysis.ROWS, rows),
        "redis": (analysis.KEYS, redis_),
    }
    judged = analysis.judge(kinds, end)
    half = end / 2
    during = [s for s in samples if s["phase"] == "traffic"]
    ages = [s["oldest_eligible_s"] for s in during]
    second_half_ages = [s["oldest_eligible_s"] for s in during if s["t"] >= half]
    peak = max(ages, default=0.0)

    def at(named: dict[str, list[tuple[float, float]]], name: str, t: float) -> float | None:
        return analysis.value_at(named.get(name, []), t)

    return {
        "minutes": args.minutes,
        "started": started_at.isoformat(timespec="seconds"),
        "config": {
            "rate_per_s": args.rate,
            "burst_every_s": args.burst_every,
            "burst_holds": args.burst_holds,
            "sample_every_s": args.sample_every,
            "sweep_every_s": SWEEP_EVERY,
            "prune_every_s": PRUNE_EVERY,
            "retention_s": kept,
            "lease_s": LEASE_SECONDS,
            "processes": "gunicorn 2×2 threads, 2 workers × 2, beat, Flower",
            "cpus": os.cpu_count(),
        },
        "holds": traffic.sent + seeded,
        "holds_api": traffic.sent,
        "holds_burst": seeded,  # through the API too
        "holds_in_table": holds_total,
        "requests": dict(sorted(traffic.counts.items())),
        "bursts": bursts,
        "events_consumed": consumed,
        "finished": finished,
        "invariants": {"ok": not violations, "violations": violations},
        "peak_oldest_eligible_s": peak,
        "peak_oldest_eligible_second_half_s": max(second_half_ages, default=0.0),
        "oldest_eligible_limit_s": analysis.OLDEST_ELIGIBLE_LIMIT_S,
        "oldest_eligible_within_limit": peak <= analysis.OLDEST_ELIGIBLE_LIMIT_S,
        "processes": {
            name: {"rss_mib_half": at(rss, name, half), "rss_mib_end": at(rss, name, end)}
            for name in sorted(rss)
        },
        "tables": {
            name: {"rows_half": at(rows, name, half), "rows_end": at(rows, name, end)}
            for name in sorted(rows)
        },
        "redis_keys": {
            "half": at(redis_, "keys", half),
            "end": at(redis_, "keys", end),
            "without_ttl_half": at(redis_, "keys_without_ttl", half),
            "without_ttl_end": at(redis_, "keys_without_ttl", end),
        },
        "redis_key_ttls": key_names,
        "flower": flower_memory(during, half, end),
        "redis_lists": {
            name: {"half": at(redis_, name, half), "end": at(redis_, name, end)}
            for name in sorted(redis_)
            if name not in ("keys", "keys_without_ttl")
        },
        "thresholds": {
            "rule": "grew: mean of the last quarter above the third quarter's by more than "
            "max(relative × third quarter's mean, absolute)",
            "rss_mib": vars(analysis.RSS),
            "rows": vars(analysis.ROWS),
            "redis": vars(analysis.KEYS),
        },
        "growth": judged,
        "grew": analysis.grown(judged),
        "samples": samples,
    }


def flower_memory(samples: list[dict[str, Any]], half: float, end: float) -> dict[str, Any]:
    """Flower's task memory: the tasks it was told of and its RSS, at half-time and at the end,
    and the RSS each task added between the first sample and the end."""
    seen = [(s["t"], s["flower_tasks_seen"], s["rss_mib"].get("flower")) for s in samples]
    seen = [(t, n, mib) for t, n, mib in seen if n is not None and mib is not None]
    if not seen:
        return {}

    def last_at(t: float) -> tuple[float, int, float]:
        return [row for row in seen if row[0] <= t][-1] if seen[0][0] <= t else seen[0]

    first, at_half, at_end = seen[0], last_at(half), last_at(end)
    tasks = at_end[1] - first[1]
    return {
        "tasks_seen_half": at_half[1],
        "tasks_seen_end": at_end[1],
        "rss_mib_half": at_half[2],
        "rss_mib_end": at_end[2],
        "kib_per_task": round((at_end[2] - first[2]) * 1024 / tasks, 2) if tasks > 0 else None,
    }


def write(out: Path, report: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    try:
        plot(report, out / "plot.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), sharex=True)
    (rss_ax, rows_ax), (redis_ax, age_ax) = axes
    colours = [plt.get_cmap("tab20")(i) for i in range(20)]
    for i, name in enumerate(report["processes"]):
        values = [s["rss_mib"].get(name) for s in samples]
        rss_ax.plot(minutes, values, label=name, lw=1, color=colours[i % len(colours)])
    rss_ax.set_title("resident memory per process (MiB)")
    rss_ax.legend(fontsize=6, ncol=2)
    for i, name in enumerate(report["tables"]):
        if max((s["rows"].get(name, 0) for s in samples), default=0) < 10:
            continue  # the fixed tables (schedule, pause, ...) stay out of the way
        values = [s["rows"].get(name) for s in samples]
        rows_ax.plot(minutes, values, label=name, lw=1, color=colours[i % len(colours)])
    rows_ax.set_yscale("symlog")
    rows_ax.set_title("rows per table (tables of ≥ 10 rows)")
    rows_ax.legend(fontsize=6)
    for name in ("keys", "keys_without_ttl", "release_queue", "events_queue", "unacked"):
        redis_ax.plot(minutes, [s["redis"][name] for s in samples], label=name, lw=1)
    redis_ax.set_title("Redis DB: keys (DBSIZE) and list lengths")
    redis_ax.set_xlabel("minutes")
    redis_ax.legend(fontsize=7)
    age_ax.plot(minutes, [s["oldest_eligible_s"] for s in samples], lw=1, color="tab:red")
    age_ax.axhline(report["oldest_eligible_limit_s"], ls="--", color="grey", lw=1)
    age_ax.set_title("oldest eligible hold (s); dashed: the 10 s target")
    age_ax.set_xlabel("minutes")
    for ax in axes.flat:
        ax.axvline(report["minutes"] / 2, ls=":", color="black", lw=1)
        for b in report["bursts"]:
            ax.axvline(b["t"] / 60, color="orange", alpha=0.3, lw=1)
    grew = ", ".join(report["grew"]) or "nothing"
    fig.suptitle(
        f"Soak: {report['minutes']:g} min, {report['holds']:,} holds "
        f"({report['config']['rate_per_s']:g}/s through the API, a burst of "
        f"{report['config']['burst_holds']:,} every {report['config']['burst_every_s']:g} s); "
        f"retention {report['config']['retention_s']} s. Dotted: half-time; orange: bursts.\n"
        f"finished {report['finished']}, invariants "
        f"{'OK' if report['invariants']['ok'] else 'VIOLATED'}, peak oldest eligible "
        f"{report['peak_oldest_eligible_s']} s; grew in the second half: {grew}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
