"""What publisher confirms cost the sweep's fan-out on RabbitMQ: one sweep batch published
through the product's confirmed path and through the old unconfirmed one, side by side.

    .venv/bin/python bench/publish_confirms.py [--quick] [--rounds N] [--warmup N]
        [--cases classic,quorum,cluster]

- confirmed: ``cleanup.release.publish.publish_release_messages`` (a channel of its own in
  confirm mode per batch; returns once RabbitMQ has acknowledged every message);
- unconfirmed: the path before publisher confirms, a few lines here (the pooled producer,
  ``app.send_task(..., producer=producer)`` per message, no confirms: it returns once the
  frames are written).

Two batches: 500 ``ReleaseMessage`` (one message per hold: the biggest batch of the single
mode, a full claim) and 10 ``BatchMessage`` of 50 holds. Each round publishes each batch once
through each path, interleaved (confirmed, unconfirmed, confirmed, ...), so a busy moment of the
machine falls on both; the release queue is purged after each publish (untimed), so its depth
stays at one batch. Warm-up rounds (connections, queue declarations) are not counted.

Cases, each a vhost of its own (fresh queues, deleted afterwards) and a child process of its
own (the settings are read at Django's set-up; the child prints its results as JSON):

- ``classic``: the machine's RabbitMQ on 127.0.0.1:5672 (guest), classic queues;
- ``quorum``: the same node, ``CLEANUP_RABBITMQ_QUEUE_TYPE=quorum`` (one replica: no cluster);
- ``cluster``: three RabbitMQ nodes of the bench's own (``tools/rabbitmq_cluster.py``, as the
  cluster drill starts them), quorum queues: a confirm waits for a majority (two replicas).

The machine's node is never touched beyond adding and deleting the bench's vhosts. Database
``reservations_bench`` (created and migrated if missing; nothing is written to it). Prints a
table (median and p90 ms per batch for each path, confirmed ÷ unconfirmed, ms per message) and
writes reports/bench/publish-confirms-<timestamp>.json. docs/PERFORMANCE.md, "Publisher
confirms on RabbitMQ".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, not the project
    sys.path.insert(0, str(ROOT))

from bench.arms import SETTINGS_MODULE, VARIABLE, events  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
BENCH_DB = "reservations_bench"
AMQP_NODE = "guest:guest@127.0.0.1:5672"
ENV = {
    "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
    VARIABLE: json.dumps(events(False)),
    "SECRET_KEY": "bench-only",
    "RESERVATIONS_API_TOKEN": "bench-only",
    "DATABASE_URL": f"{PG_SERVER}/{BENCH_DB}",
    "WORKER_METRICS_PORT": "0",
}
# Always the bench's own settings module and database (broker and queue type: per case).
FORCED = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")

CASES = {
    "classic": "machine node, classic queues",
    "quorum": "machine node, quorum queues",
    "cluster": "3-node cluster, quorum queues",
}
QUEUE_TYPE = {"classic": "classic", "quorum": "quorum", "cluster": "quorum"}
PATHS = ("confirmed", "unconfirmed")
HOLDS = 500
BATCH_HOLDS = 50
KINDS = {
    "per_hold": f"{HOLDS} messages x 1 hold",
    "batched": f"{HOLDS // BATCH_HOLDS} messages x {BATCH_HOLDS} holds",
}
ROUNDS, WARMUP = 40, 5
QUICK_ROUNDS, QUICK_WARMUP = 6, 2
CHILD_TIMEOUT_SECONDS = 900


# --- the numbers and the table (no broker, no Django) -------------------------------------


def summarize(samples_ms: Sequence[float], messages: int) -> dict[str, Any]:
    """Median and p90 (nearest rank) of the batch times, and the median per message."""
    ordered = sorted(samples_ms)
    p90 = ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]
    median = statistics.median(ordered)
    return {
        "rounds": len(ordered),
        "median_ms": round(median, 2),
        "p90_ms": round(p90, 2),
        "min_ms": round(ordered[0], 2),
        "ms_per_message": round(median / messages, 4),
    }


def compare(samples: dict[str, list[float]], messages: int, holds: int) -> dict[str, Any]:
    """One batch kind of one case: each path's summary, confirmed ÷ unconfirmed (of the
    medians, and the median of the rounds' own ratios, each round's pair run back to back)."""
    out: dict[str, Any] = {"messages": messages, "holds": holds}
    out.update({path: summarize(samples[path], messages) for path in PATHS})
    out["ratio"] = round(out["confirmed"]["median_ms"] / out["unconfirmed"]["median_ms"], 2)
    paired = [c / u for c, u in zip(samples["confirmed"], samples["unconfirmed"], strict=True)]
    out["paired_ratio_median"] = round(statistics.median(paired), 2)
    return out


HEADER = (
    "case", "batch", "confirmed median / p90", "unconfirmed median / p90", "ratio",
    "ms/msg confirmed", "ms/msg unconfirmed",
)  # fmt: skip


def table_rows(cases: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """A row per case and batch kind; a case that did not run says why."""
    rows: list[tuple[str, ...]] = []
    for case, result in cases.items():
        label = CASES.get(case, case)
        if "skipped" in result:
            rows.append((label, "-", "SKIPPED: " + result["skipped"], "", "", "", ""))
            continue
        for kind, m in result["kinds"].items():
            c, u = m["confirmed"], m["unconfirmed"]
            rows.append(
                (
                    label,
                    KINDS.get(kind, kind),
                    f"{c['median_ms']:.1f} / {c['p90_ms']:.1f} ms",
                    f"{u['median_ms']:.1f} / {u['p90_ms']:.1f} ms",
                    f"{m['ratio']:.2f}",
                    f"{c['ms_per_message']:.3f}",
                    f"{u['ms_per_message']:.3f}",
                )
            )
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [HEADER, *rows]
    )


# --- one case, in a child process with its own settings ------------------------------------


def run_case(rounds: int, warmup: int) -> dict[str, Any]:
    """Publish each batch through each path, interleaved; the release queue purged after each
    publish. Django is set up here, with the broker and queue type of the environment."""
    import django

    django.setup()
    from celery import current_app as app

    from cleanup.broker.confirms import confirms_available
    from cleanup.conf import cleanup_settings
    from cleanup.release.messages import BatchMessage, ReleaseMessage
    from cleanup.release.publish import PUBLISH_PIPELINE, publish_release_messages, send_release

    queue = cleanup_settings().release_queue
    expires_at = datetime.now(UTC)
    trace = "bench-confirms"
    holds = [(rid, 1, expires_at) for rid in range(1, HOLDS + 1)]
    batches: dict[str, list[ReleaseMessage | BatchMessage]] = {
        "per_hold": [ReleaseMessage.for_hold(rid, v, at, 0, trace) for rid, v, at in holds],
        "batched": [
            BatchMessage.for_holds(holds[i : i + BATCH_HOLDS], 0, trace)
            for i in range(0, HOLDS, BATCH_HOLDS)
        ],
    }

    def unconfirmed(messages: Sequence[ReleaseMessage | BatchMessage]) -> None:
        # publish_release_messages before publisher confirms (no batching on py-amqp)
        with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_PIPELINE):
            for message in messages:
                send_release(message, queue, producer)

    paths: dict[str, Callable[[Sequence[ReleaseMessage | BatchMessage]], None]] = {
        "confirmed": publish_release_messages,
        "unconfirmed": unconfirmed,
    }

    def purge() -> int:
        # on the pooled producer's channel, the one the unconfirmed path published on: the
        # broker handles it after those publishes
        with app.producer_or_acquire() as producer:
            return int(producer.channel.queue_purge(queue) or 0)

    samples: dict[str, dict[str, list[float]]] = {kind: {p: [] for p in PATHS} for kind in batches}
    published = purged = 0
    for round_ in range(warmup + rounds):
        for kind, messages in batches.items():
            for path, publish in paths.items():
                started = time.perf_counter()
                publish(messages)
                took = (time.perf_counter() - started) * 1000
                purged += purge()
                published += len(messages)
                if round_ >= warmup:
                    samples[kind][path].append(took)
    purged += purge()  # anything the last purge came too early for
    with app.producer_or_acquire() as producer:
        confirmed = confirms_available(producer.channel)  # the product took its RabbitMQ branch
    return {
        "queue": queue,
        "queue_type": cleanup_settings().rabbitmq_queue_type,
        "confirms": confirmed,
        "rounds": rounds,
        "warmup": warmup,
        "messages_published": published,
        "messages_purged": purged,
        "kinds": {
            kind: compare(samples[kind], len(messages), HOLDS) for kind, messages in batches.items()
        },
        "samples_ms": {
            kind: {path: [round(s, 3) for s in values] for path, values in by_path.items()}
            for kind, by_path in samples.items()
        },
    }


# --- the brokers, and the parent ------------------------------------------------------------


def _ctl(*args: str) -> str:
    """rabbitmqctl on the machine's node (only ever for the bench's own vhosts)."""
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()[-400:]}")
    return done.stdout


# A broker for one case: its URL, and a function listing its vhost's queues (name: type).
Broker = tuple[str, Callable[[], dict[str, str]]]


@contextmanager
def machine_vhost(case: str) -> Iterator[Broker]:
    """A vhost of the bench's own on the machine's node, deleted afterwards."""
    vhost = f"bench_confirms_{case}_{os.getpid()}"
    _ctl("add_vhost", vhost)

    def queues() -> dict[str, str]:
        listed = _ctl("list_queues", "-p", vhost, "name", "type")
        return dict(line.split("\t")[:2] for line in listed.splitlines()[1:] if "\t" in line)

    try:
        _ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://{AMQP_NODE}/{vhost}", queues
    finally:
        _ctl("delete_vhost", vhost)


@contextmanager
def cluster_vhost() -> Iterator[Broker]:
    """Three nodes of the bench's own in one cluster (files in a temporary directory, removed
    afterwards), a vhost on them; kombu's failover URL of the three, the first tried first."""
    from tools.rabbitmq_cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="bench-confirms-rabbitmq-"))
    cluster = Cluster(root, prefix="bench")
    try:
        started = time.monotonic()
        cluster.start()
        print(f"  cluster up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        cluster.add_vhost("bench_confirms")

        def queues() -> dict[str, str]:
            return {name: q["type"] for name, q in cluster.queues("bench_confirms").items()}

        yield cluster.url("bench_confirms", cluster.nodes), queues
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def broker(case: str) -> AbstractContextManager[Broker]:
    return cluster_vhost() if case == "cluster" else machine_vhost(case)


def child(case: str, url: str, rounds: int, warmup: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "CELERY_BROKER_URL": url,
        "CLEANUP_RABBITMQ_QUEUE_TYPE": QUEUE_TYPE[case],
    }
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--case", case,
         "--rounds", str(rounds), "--warmup", str(warmup)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        timeout=CHILD_TIMEOUT_SECONDS,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"case {case}: the child exited {done.returncode}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test")
    parser.add_argument("--rounds", type=int, help=f"counted rounds (default {ROUNDS})")
    parser.add_argument("--warmup", type=int, help=f"rounds not counted (default {WARMUP})")
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES)
    )
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ or k in FORCED})
    if args.case:
        print(json.dumps(run_case(rounds, warmup)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {', '.join(CASES)}")
    from bench.migrated import ensure_migrated_database
    from bench.paths import RESULTS, STAMP
    from tools.rabbitmq_cluster import MissingTool

    # the settings need a broker URL to load (migrate never connects to it)
    os.environ["CELERY_BROKER_URL"] = f"amqp://{AMQP_NODE}/bench_confirms_unused"
    ensure_migrated_database(ENV["DATABASE_URL"])
    report: dict[str, Any] = {
        "started": STAMP,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "note": "2 cores, shared with other people's test runs",
        },
        "argv": sys.argv[1:],
        "rounds": rounds,
        "warmup": warmup,
        "database": BENCH_DB,
        "cases": {},
    }
    for case in cases:
        print(f"{case}: {CASES[case]} ({rounds} rounds after {warmup})", file=sys.stderr)
        try:
            with broker(case) as (url, queues):
                result = child(case, url, rounds, warmup)
                result["broker"] = url.replace("guest:guest@", "")
                result["declared_queues"] = queues()  # the type RabbitMQ gave each queue
        except MissingTool as exc:
            result = {"skipped": str(exc)}
        report["cases"][case] = result
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"publish-confirms-{STAMP}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + format_table(table_rows(report["cases"])))
    print(
        "\nratio: confirmed ÷ unconfirmed medians; ms/msg: the median batch ÷ its messages."
        f"\nreport: {path.relative_to(ROOT)}"
    )
    lost = {
        case: (r["messages_published"], r["messages_purged"])
        for case, r in report["cases"].items()
        if "skipped" not in r and r["messages_published"] != r["messages_purged"]
    }
    if lost:
        print(f"messages published != purged (published, purged): {lost}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
