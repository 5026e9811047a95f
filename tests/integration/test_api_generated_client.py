"""docs/API.md's program on a generated client ("A client in Python"), run as written against a
live gunicorn: openapi-python-client (requirements-api-client-tools.txt, installed with its
hashes into .cache/api-client/tools/, never into .venv) generates the package from the served
document, and the program takes a hold under an Idempotency-Key and sends it again, renews,
confirms, takes and cancels another, and reads problem answers through the generated ``Error``.

Run by a client with a generous limit and by one allowed two requests a minute: the second must
wait out its 429s after their Retry-After. Its waits are not slept: the program's
``time.sleep`` is replaced by one that records the seconds and lets the minute pass (it forgets
the client's counted requests in the limiter's Redis), so a retry that did not wait is refused
again and the program fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reservations import clients, ratelimit, services
from reservations.models import ApiClient, Reservation
from tests.support import ROOT
from tests.support.missing_tools import skip_for_missing
from tests.support.project_scripts import load_script

pytestmark = [pytest.mark.slow]

API_DOC = ROOT / "docs" / "API.md"
GENERATOR_LOCK = ROOT / "requirements-api-client-tools.txt"
GENERATOR_TOOLS = ROOT / ".cache" / "api-client" / "tools"
PACKAGE = "reservations_api_client"

# Runs the program (argv[1]) as its own ``__main__`` with ``time.sleep`` replaced: each wait is
# printed, then the limiter forgets the client's requests (Redis URL argv[2], key argv[3]), as
# if the Retry-After seconds had passed.
WAITS_RECORDED = """
import runpy, sys, time
import redis

limiter = redis.Redis.from_url(sys.argv[2])

def the_time_passes(seconds):
    print("waited", seconds, flush=True)
    limiter.delete(sys.argv[3])

time.sleep = the_time_passes
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@pytest.fixture(autouse=True)
def _no_earlier_requests(clear_rate_limits: None) -> None:
    pass


@pytest.fixture(scope="module")
def generator_tools() -> Path:
    """openapi-python-client and its dependencies, installed from their hashed lock (once per
    lock content, shared with scripts/library_suites.py's install)."""
    try:
        return load_script("library_suites").install_lock(GENERATOR_LOCK, GENERATOR_TOOLS)
    except subprocess.CalledProcessError as exc:
        skip_for_missing(
            "openapi-python-client",
            f"pip could not install {GENERATOR_LOCK.name} into {GENERATOR_TOOLS.relative_to(ROOT)} "
            f"(exit {exc.returncode}; no network or package index?)",
        )


def tools_env(*path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    # the generator formats what it writes with the ruff it depends on (its post hooks)
    env["PATH"] = os.pathsep.join([str(GENERATOR_TOOLS / "bin"), env.get("PATH", "")])
    return env


@dataclass(frozen=True)
class GeneratedClient:
    package_dir: Path  # holds the package reservations_api_client
    program: Path  # docs/API.md's program, as written there


@pytest.fixture
def generated_client(web, tmp_path: Path, generator_tools: Path) -> Iterator[GeneratedClient]:
    """The package generated from the live document, and the documented program beside it."""
    out = tmp_path / "reservations-api-client"
    generated = subprocess.run(
        [sys.executable, "-m", "openapi_python_client", "generate"]
        + ["--url", f"{web.base_url}/api/v1/openapi.json", "--output-path", str(out)],
        cwd=tmp_path,
        env=tools_env(generator_tools),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = generated.stdout + generated.stderr
    # a warning names an operation or schema the generator skipped or could not type
    assert generated.returncode == 0 and "Warning" not in output, output[-4000:]
    assert (out / PACKAGE / "api" / "holds" / "create_hold.py").exists(), output[-4000:]
    found = re.search(
        r"<!-- api-generated-client:start -->\n```python\n(.*?)```", API_DOC.read_text(), re.DOTALL
    )
    assert found, "docs/API.md has no api-generated-client block"
    program = tmp_path / "book_seats.py"
    program.write_text(found.group(1))
    yield GeneratedClient(out, program)


@pytest.mark.parametrize("requests_per_minute", [1000, 2], ids=["generous", "two-a-minute"])
def test_the_documented_program_on_the_generated_client(
    web, generated_client: GeneratedClient, requests_per_minute: int
) -> None:
    # given a client and an offering with three seats
    api_client = ApiClient.objects.create(
        name="generated",
        can_write=True,
        all_offerings=True,
        requests_per_minute=requests_per_minute,
    )
    offering = services.create_offering("generated client", capacity=3)
    env = tools_env(generated_client.package_dir, GENERATOR_TOOLS)
    env.update(
        RESERVATIONS_URL=web.base_url,
        RESERVATIONS_TOKEN=clients.issue_token(api_client),
        RESERVATIONS_OFFERING_ID=str(offering.pk),
    )
    limiter_key = f"{ratelimit.KEY_PREFIX}{api_client.pk}"
    # when the program runs
    run = subprocess.run(
        [sys.executable, "-c", WAITS_RECORDED, str(generated_client.program)]
        + [ratelimit.redis_url(), limiter_key],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # then it ran to its end, one hold confirmed and one cancelled: two holds made, the one
    # sent again under its key no third, and one seat taken
    assert run.returncode == 0, run.stdout + run.stderr
    holds = Reservation.objects.filter(offering=offering).order_by("pk")
    assert [(h.holder, h.status, h.version) for h in holds] == [
        ("ann", "confirmed", 3),
        ("bob", "cancelled", 2),
    ]
    offering.refresh_from_db()
    assert offering.seats_available == 2
    confirmed, cancelled = holds
    # and it printed what a user reads: the same hold twice, the problems' status and code
    said = [line for line in run.stdout.splitlines() if not line.startswith("waited ")]
    assert said == [
        f"held {confirmed.pk} held 1 sent again: {confirmed.pk}",
        "key reused: 422 idempotency_key_reused",
        f"renewed {confirmed.pk} held 2",
        f"confirmed {confirmed.pk} confirmed 3",
        f"cancelled {cancelled.pk} cancelled 2",
        "cancel again: 409 not_held",
    ], run.stdout
    # and the client of two requests a minute waited out its 429s after their Retry-After
    waits = [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("waited ")]
    if requests_per_minute == 1000:
        assert waits == []
    else:
        assert len(waits) >= 3 and all(1 <= seconds <= 60 for seconds in waits), run.stdout
