"""``manage.py capacity_plan``: the arithmetic it prints, from arguments or a burst report, and
its ``--json`` output."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.management import call_command

from tests.support.commands import run_from_argv


def test_command_prints_the_arithmetic(capsys):
    call_command(
        "capacity_plan",
        "--holds",
        "12000",
        "--window-seconds",
        "300",
        "--per-worker-rate",
        "20",
        "--utilization",
        "0.7",
    )
    out = capsys.readouterr().out
    assert "12,000 holds / 300 s = 40 msg/s" in out
    assert "at utilization 1.0: ceil(2) = 2 consumers" in out
    assert "= 3 consumers" in out


def test_command_from_a_burst_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps({"capacity_inputs": {"service_time_s": 0.05, "arrival_rate_per_s": 40}})
    )
    call_command("capacity_plan", "--from-report", str(report), "--utilization", "1.0")
    assert "at utilization 1.0: ceil(2) = 2 consumers" in capsys.readouterr().out


def test_capacity_plan_json_still_parses(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--arrival-rate", "40", "--service-time", "0.05", "--json"]
    assert run_from_argv("capacity_plan", *args) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert plan["consumers_total"] >= 3
