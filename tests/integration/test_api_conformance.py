"""The OpenAPI document says what the server accepts and answers: schemathesis's command line,
``st run --checks all``, against a live gunicorn, as a client developer would run it.

All its phases run: the document's examples, the coverage phase (boundaries of every bound the
document states, and values just outside them), fuzzing, and the stateful phase, which follows
the document's links from a created hold to reading, renewing, confirming and cancelling it.
Every check applies: no 5xx; statuses, content types, headers and bodies as documented;
schema-valid requests accepted and schema-invalid ones refused; a method a path does not
document answered 405; a request without credentials answered 401.

Two settings, both in the configuration file below, and why:

- every request names the test's real offering, so holds are made and the stateful phase has
  holds to follow (generated ids name no offering: the 404s are exercised by the other
  operations' generated ids, and the unit tests);
- a schema-valid request may also be answered 422 ``idempotency_key_reused``: schemathesis
  sends the same short ``Idempotency-Key`` values with different bodies, and refusing a key
  reused for another request is the point of the header (docs/API.md, "Idempotency-Key"),
  not a rejection of the data.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reservations import clients, services
from reservations.models import ApiClient, Reservation

pytestmark = [pytest.mark.slow]

EXAMPLES_PER_OPERATION = 30
SEED = 20261207  # the same cases on every run: a failure reproduces


@pytest.fixture(autouse=True)
def _no_earlier_requests(clear_rate_limits: None) -> None:
    pass


@pytest.fixture
def web_options() -> dict[str, Any]:
    return {"workers": 2, "threads": 2}


def schemathesis_cli() -> list[str]:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("schemathesis's `st` is not installed beside this Python (requirements-dev)")
    return [found]


def test_schemathesis_with_every_check_finds_nothing(web, tmp_path):
    # given a client with every scope and a generous limit, and an offering with room
    client = ApiClient.objects.create(
        name="schemathesis", can_write=True, all_offerings=True, requests_per_minute=10**6
    )
    token = clients.issue_token(client)
    offering = services.create_offering("conformance", capacity=10**6)
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        "[checks.positive_data_acceptance]\n"
        'expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]\n'
        "\n[parameters]\n"
        f'"path.offering_id" = {offering.pk}\n'
    )
    # when
    run = subprocess.run(
        [
            *schemathesis_cli(),
            "--config-file",
            str(config),
            "--no-color",
            "run",
            f"{web.base_url}/api/v1/openapi.json",
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {token}",
            "--max-examples",
            str(EXAMPLES_PER_OPERATION),
            "--seed",
            str(SEED),
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # then
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "Stateful" in output and "failures" not in output.split("SUMMARY")[-1], output[-3000:]
    # and the cases reached the success paths, not only refusals: holds were made, and the
    # stateful phase changed some of them
    holds = Reservation.objects.filter(offering=offering, client=client)
    assert holds.exists()
    print("STATUSES", sorted(holds.values_list("status", "version").distinct()))
    assert holds.exclude(status="held", version=1).exists()
