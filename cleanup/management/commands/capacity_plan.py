"""How many cleanup consumers a burst needs: peak rate × service time ÷ utilization target,
plus headroom for retries and the loss of one node. Prints the arithmetic step by step.

    python manage.py capacity_plan --holds 12000 --window-seconds 300 --per-worker-rate 20
    python manage.py capacity_plan --from-report reports/burst/<ts>/report.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.operations.scaling import capacity
from reservations.commands import ProjectCommand, add_options


class Command(ProjectCommand):
    help = "Plan cleanup consumers for a burst and print the arithmetic."

    def add_arguments(self, parser: CommandParser) -> None:
        add_options(parser, [
            ("--holds", int, None, "holds that become eligible in the window (default: none; "
             "then --arrival-rate or --from-report gives the rate)"),
            ("--window-seconds", float, None, "the burst window, seconds (default: none)"),
            ("--arrival-rate", float, None,
             "peak msg/s, instead of --holds / --window-seconds (default: none)"),
            ("--service-time", float, None, "seconds per release (default: none; then "
             "1 / --per-worker-rate, or measured in --from-report)"),
            ("--per-worker-rate", float, None,
             "releases/s per consumer, instead of --service-time (default: none)"),
            ("--utilization", float, 0.7, "utilization target per consumer"),
            ("--retry-ratio", float, 0.0, "extra deliveries per message (retries, redeliveries)"),
            ("--consumers-per-node", int, 2, "consumers (pool processes) per node"),
            ("--nodes", int, 1, "nodes that may be lost: >= 1 adds one node of headroom; 0: none"),
            ("--from-report", Path, None,
             "a burst drill's report.json: its measured service time and rate (default: none)"),
            ("--json", bool, False, "print the plan as JSON"),
        ])  # fmt: skip

    def handle(self, *args: Any, **opts: Any) -> None:
        arrival = opts["arrival_rate"]
        service = opts["service_time"]
        sources = {"arrival_source": "given", "service_source": "given"}
        if opts["from_report"]:
            try:
                report = json.loads(opts["from_report"].read_text())
                inputs = capacity.inputs_from_report(report)
            except (OSError, ValueError) as exc:
                raise CommandError(f"{opts['from_report']}: {exc}") from exc
            if service is None:
                service = inputs["service_time_s"]
                sources["service_source"] = "measured in the burst report"
            if arrival is None and opts["holds"] is None:
                arrival = inputs["arrival_rate_per_s"]
                sources["arrival_source"] = "the burst report's holds ÷ window"
            self.stdout.write(f"from report {opts['from_report']}: measured S = {service:g} s")
        try:
            result = capacity.plan(
                arrival_rate_per_s=arrival,
                holds=opts["holds"],
                window_seconds=opts["window_seconds"],
                service_time_s=service,
                per_worker_rate=opts["per_worker_rate"],
                utilization=opts["utilization"],
                retry_ratio=opts["retry_ratio"],
                consumers_per_node=opts["consumers_per_node"],
                lose_one_node=opts["nodes"] > 0,
                **sources,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result.as_dict(), indent=2))
            return
        for i, step in enumerate(result.steps, 1):
            self.stdout.write(f"{i}. {step}")
        self.stdout.write(
            f"=> {result.consumers_total} consumers on {result.nodes} nodes "
            f"({result.consumers_at_target} for the load at {result.utilization:g} utilization)"
        )
