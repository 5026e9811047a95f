"""Capacity arithmetic for the cleanup consumers (pure functions, no Django).

The reference article's rule: required consumers = peak tasks per second × service time ÷ the
utilization target. On top of that: headroom for retries (each retry is one more delivery, so
the arrival rate grows by the retry ratio) and the loss of one node (N+1 nodes).

Worked example (the article's numbers): 12,000 holds eligible within 5 minutes is
12,000 / 300 s = 40 msg/s (the article's text says 200/s; its own numbers give 40). One worker
completes 20 releases/s, so the service time is 1/20 = 0.05 s and the offered load is
40 × 0.05 = 2 busy consumers: 2 consumers at utilization 1.0, ceil(2 / 0.7) = 3 at a 0.7 target,
before headroom for retries and for losing a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cleanup.conf import cleanup_settings

# The counting arithmetic lives in the pipeline (the sweep sizes release messages with it, and
# the pipeline may not import this package): re-exported here for the capacity plan.
from cleanup.release.sizing import ceil_whole as ceil_consumers
from cleanup.release.sizing import offered_load


def compute_desired_consumers(
    arrival_rate_per_s: float,
    service_time_s: float,
    utilization: float = 0.7,
    retry_ratio: float = 0.0,
) -> int:
    """Consumers that keep up with ``arrival_rate_per_s`` at ``utilization``:
    ceil(λ × (1 + retry_ratio) × S ÷ utilization). The metrics module's
    ``reservation_cleanup_desired_consumers`` gauge can call this with the measured arrival
    rate and service time (0 arrivals → 0 consumers)."""
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    if retry_ratio < 0:
        raise ValueError("retry_ratio must be >= 0")
    return ceil_consumers(
        offered_load(arrival_rate_per_s * (1 + retry_ratio), service_time_s) / utilization
    )


@dataclass
class CapacityPlan:
    holds: int | None
    window_seconds: float | None
    arrival_rate_per_s: float
    service_time_s: float
    utilization: float
    retry_ratio: float
    consumers_per_node: int
    offered_load: float = 0.0
    consumers_at_full_utilization: int = 0
    consumers_at_target: int = 0
    consumers_with_retries: int = 0
    nodes_for_load: int = 0
    nodes: int = 0
    consumers_total: int = 0
    steps: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items()}


def plan(
    *,
    arrival_rate_per_s: float | None = None,
    holds: int | None = None,
    window_seconds: float | None = None,
    service_time_s: float | None = None,
    per_worker_rate: float | None = None,
    utilization: float = 0.7,
    retry_ratio: float = 0.0,
    consumers_per_node: int = 2,
    lose_one_node: bool = True,
    arrival_source: str = "given",
    service_source: str = "given",
) -> CapacityPlan:
    """The whole plan, with every step written out in ``steps`` for an operator to check."""
    steps: list[str] = []
    if arrival_rate_per_s is None:
        if holds is None or not window_seconds:
            raise ValueError("give an arrival rate, or holds and a window > 0 s")
        arrival_rate_per_s = holds / window_seconds
        steps.append(
            f"peak arrival rate λ = {holds:,} holds / {window_seconds:g} s "
            f"= {arrival_rate_per_s:g} msg/s"
        )
    else:
        steps.append(f"peak arrival rate λ = {arrival_rate_per_s:g} msg/s ({arrival_source})")
    if service_time_s is None:
        if not per_worker_rate:
            raise ValueError("give a service time or a per-worker rate > 0")
        service_time_s = 1 / per_worker_rate
        steps.append(
            f"service time S = 1 / {per_worker_rate:g} releases/s per consumer "
            f"= {service_time_s:g} s"
        )
    else:
        steps.append(f"service time S = {service_time_s:g} s ({service_source})")
    if consumers_per_node < 1:
        raise ValueError("consumers_per_node must be >= 1")
    result = CapacityPlan(
        holds,
        window_seconds,
        arrival_rate_per_s,
        service_time_s,
        utilization,
        retry_ratio,
        consumers_per_node,
    )
    result.offered_load = offered_load(arrival_rate_per_s, service_time_s)
    steps.append(
        f"offered load λ × S = {arrival_rate_per_s:g} × {service_time_s:g} "
        f"= {result.offered_load:g} busy consumers"
    )
    result.consumers_at_full_utilization = compute_desired_consumers(
        arrival_rate_per_s, service_time_s, 1.0
    )
    steps.append(
        f"at utilization 1.0: ceil({result.offered_load:g}) "
        f"= {result.consumers_at_full_utilization} consumers (no slack at all)"
    )
    result.consumers_at_target = compute_desired_consumers(
        arrival_rate_per_s, service_time_s, utilization
    )
    steps.append(
        f"at utilization target {utilization:g}: ceil({result.offered_load:g} / {utilization:g}) "
        f"= ceil({result.offered_load / utilization:g}) = {result.consumers_at_target} consumers"
    )
    result.consumers_with_retries = compute_desired_consumers(
        arrival_rate_per_s, service_time_s, utilization, retry_ratio
    )
    load_r = result.offered_load * (1 + retry_ratio)
    steps.append(
        f"retry headroom ({retry_ratio:g} extra deliveries per message): "
        f"ceil({result.offered_load:g} × {1 + retry_ratio:g} / {utilization:g}) "
        f"= ceil({load_r / utilization:g}) = {result.consumers_with_retries} consumers"
    )
    result.nodes_for_load = max(1, math.ceil(result.consumers_with_retries / consumers_per_node))
    steps.append(
        f"nodes for the load: ceil({result.consumers_with_retries} / {consumers_per_node} "
        f"consumers per node) = {result.nodes_for_load}"
    )
    result.nodes = result.nodes_for_load + (1 if lose_one_node else 0)
    result.consumers_total = result.nodes * consumers_per_node
    if lose_one_node:
        steps.append(
            f"survive the loss of one node: {result.nodes_for_load} + 1 = {result.nodes} nodes "
            f"× {consumers_per_node} = {result.consumers_total} consumers"
        )
    else:
        steps.append(
            f"no node-loss headroom: {result.nodes} nodes × {consumers_per_node} "
            f"= {result.consumers_total} consumers"
        )
    result.steps = steps
    return result


def inputs_from_report(report: dict[str, object]) -> dict[str, float]:
    """Arrival rate and measured service time from a burst ``report.json``."""
    cap = report.get("capacity_inputs")
    if not isinstance(cap, dict):
        raise ValueError("report has no capacity_inputs section (not a burst report?)")
    service = cap.get("service_time_s")
    arrival = cap.get("arrival_rate_per_s")
    if not isinstance(service, int | float) or service <= 0:
        raise ValueError("report has no measured service time")
    if not isinstance(arrival, int | float) or arrival <= 0:
        raise ValueError("report has no arrival rate")
    return {"service_time_s": float(service), "arrival_rate_per_s": float(arrival)}


# Consumers are sized to be this busy at the measured arrival rate: a queue served at full
# utilization grows without bound at the first burst (the capacity_plan report shows why).
TARGET_UTILIZATION = 0.7


# Measured over this window: terminal outcomes per second and their mean duration (receipts,
# index cleanup_receipt_created_idx).
DESIRED_WINDOW_S = 60


def desired_consumers(
    processed_in_window: int,
    mean_duration_ms: float | None,
    backlog_growth_per_s: float,
) -> float | None:
    """``reservation_cleanup_desired_consumers``: consumers = arrival rate × service time ÷
    utilization (``cleanup.operations.scaling.capacity.compute_desired_consumers``), with
    - arrival rate = holds processed per second over the window + the growth of the eligible
      backlog per second (what arrives is either processed or waiting), or the planned peak
      ``CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S`` when that is higher;
    - service time = 1 / ``CLEANUP_CAPACITY_PER_CONSUMER_PER_S`` when set (e.g. from a burst
      report, which includes Celery's own per-message cost), else the receipts' mean duration
      (the release itself only, so a lower bound);
    - ``CLEANUP_CAPACITY_HEADROOM`` as the retry/headroom ratio; ``TARGET_UTILIZATION``.
    None (not exported) while no service time is known.
    """
    conf = cleanup_settings()
    planned = conf.capacity_peak_arrivals_per_s
    per_consumer = conf.capacity_per_consumer_per_s
    headroom = conf.capacity_headroom
    arrivals = max(planned, processed_in_window / DESIRED_WINDOW_S + max(0.0, backlog_growth_per_s))
    if per_consumer > 0:
        service_time = 1.0 / per_consumer
    elif mean_duration_ms:
        service_time = mean_duration_ms / 1000.0
    else:
        return None
    return float(compute_desired_consumers(arrivals, service_time, TARGET_UTILIZATION, headroom))
