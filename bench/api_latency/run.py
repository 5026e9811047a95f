"""Request latency of the JSON API as served, beside the same two operations written minimally
with django-ninja (and Django REST framework, when installed), in one run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/reservations_apibench \\
        .venv/bin/python -m bench.api_latency.run [--requests 400]

Needs django-ninja (requirements-dev.txt); djangorestframework and drf-spectacular, installed
by hand, add their variant. The minimal variants are a fixed reference: comparing ``x served``
between runs of two versions of the API compares the versions. Each request goes through Django's
whole stack in-process (middleware, URL routing, the view, PostgreSQL), with django.test's
Client, so the numbers are the framework's cost plus the same database work, without a
network in between. The variants take turns, in a new random order on every round, so a
drift of the machine touches them alike. Prints a table; writes reports/bench/api-latency-*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/reservations_apibench"
# "served": the API as reservations.urls serves it; "ninja" and "drf": the same two operations
# written minimally with each library (bench/api_latency/variants.py), a fixed reference that
# lets runs of different versions of the served API be compared.
VARIANTS: tuple[str, ...] = ("served", "ninja", "drf")


def measure(requests: int, variants: tuple[str, ...]) -> dict[str, Any]:
    from django.test import Client

    from reservations import clients, services
    from reservations.models import ApiClient

    offering = services.create_offering("latency bench", capacity=10**7)
    api_client, _ = ApiClient.objects.update_or_create(
        name="latency bench",
        defaults={"can_write": True, "all_offerings": True, "requests_per_minute": 10**9},
    )
    token = clients.issue_token(api_client)
    auth = {"Authorization": f"Bearer {token}"}
    http = Client()
    body = json.dumps({"holder": "bench", "ttl_seconds": 600})
    made = http.post(
        f"/served/offerings/{offering.pk}/holds",
        body,
        content_type="application/json",
        headers=auth,
    )
    hold_id = made.json()["id"]

    def get(variant: str) -> Any:
        return http.get(f"/{variant}/holds/{hold_id}", headers=auth)

    def post(variant: str) -> Any:
        return http.post(
            f"/{variant}/offerings/{offering.pk}/holds",
            body,
            content_type="application/json",
            headers=auth,
        )

    operations = {"GET hold": (get, 200), "POST hold": (post, 201)}
    # Same answers, or the comparison is not of the same work.
    for name, (send, status) in operations.items():
        answers = {v: send(v) for v in variants}
        assert {a.status_code for a in answers.values()} == {status}, name
        shapes = {v: tuple(sorted(a.json())) for v, a in answers.items()}
        assert len(set(shapes.values())) == 1, (name, shapes)
    timings: dict[str, dict[str, list[float]]] = {
        op: {v: [] for v in variants} for op in operations
    }
    order = list(variants)
    for round_number in range(requests + 50):
        random.shuffle(order)
        for op, (send, status) in operations.items():
            for variant in order:
                started = time.perf_counter_ns()
                response = send(variant)
                elapsed = (time.perf_counter_ns() - started) / 1000
                assert response.status_code == status, (variant, op, response.content)
                if round_number >= 50:  # the first rounds warm caches and connections
                    timings[op][variant].append(elapsed)
    results: dict[str, Any] = {}
    for op, per_variant in timings.items():
        served = statistics.median(per_variant["served"])
        results[op] = {
            v: {
                "median_us": round(statistics.median(t), 1),
                "p95_us": round(statistics.quantiles(t, n=20)[18], 1),
                "mean_us": round(statistics.fmean(t), 1),
                "median_vs_served": round(statistics.median(t) / served, 3),
                "requests": len(t),
            }
            for v, t in per_variant.items()
        }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="per variant and operation")
    args = parser.parse_args()
    os.environ.setdefault("DATABASE_URL", DEFAULT_DB)
    # The API's rate limiter counts the bench client's requests in this Redis.
    os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/5")
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.api_latency.settings"
    sys.path.insert(0, str(ROOT))
    from bench.migrated import ensure_migrated_database

    ensure_migrated_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    import ninja
    from django.conf import settings

    variants = (
        VARIANTS
        if getattr(settings, "HAS_DRF", False)
        else tuple(v for v in VARIANTS if v != "drf")
    )
    results = measure(args.requests, variants)
    print(f"{'operation':<10} {'variant':<6} {'median µs':>10} {'p95 µs':>9} {'x served':>7}")
    for op, per_variant in results.items():
        for variant, r in per_variant.items():
            print(
                f"{op:<10} {variant:<6} {r['median_us']:>10} {r['p95_us']:>9} "
                f"{r['median_vs_served']:>7}"
            )
    report = {
        "command": " ".join(
            [Path(sys.executable).name, "-m", "bench.api_latency.run", *sys.argv[1:]]
        ),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "versions": {"django-ninja": ninja.__version__, **_drf_version()},
        "results": results,
    }
    out = ROOT / "reports" / "bench" / f"api-latency-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out.relative_to(ROOT)}")
    return 0


def _drf_version() -> dict[str, str]:
    try:
        import rest_framework
    except ImportError:
        return {}
    return {"djangorestframework": rest_framework.VERSION}


if __name__ == "__main__":
    raise SystemExit(main())
