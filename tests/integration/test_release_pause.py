"""The "pause releases" switch with real workers on real Redis/RabbitMQ and PostgreSQL: while
paused, every worker stops consuming the release queue, and sweeps go on claiming and publishing
(the backlog waits in the queue, visible); resumed, the workers drain it."""

from __future__ import annotations

import pytest

from cleanup.broker.readers import queue_stats
from cleanup.conf import cleanup_settings
from cleanup.release.pause import set_paused
from cleanup.worker.pause_step import POLL_INTERVAL_S
from tests.support.fleet import (
    Worker,
    claim_counts,
    create_eligible_holds,
    log_lines,
    released_count,
    run_sweeps,
    sweep_until_each_worker_swept,
    wait_until,
)

pytestmark = [pytest.mark.workers]


def _all_say(workers: list[Worker], needle: str, at_least: int) -> bool:
    return all(len(log_lines([w.log_path], needle)) >= at_least for w in workers)


def test_paused_releases_wait_in_the_queue_while_sweeps_go_on(
    workers: list[Worker], clean: None
) -> None:
    pauses = min(len(log_lines([w.log_path], "releases paused")) for w in workers)
    resumes = min(len(log_lines([w.log_path], "releases resumed")) for w in workers)
    try:
        # given: an operator paused releases, and every worker followed
        set_paused(True, "ops", "drill")
        wait_until(lambda: _all_say(workers, "releases paused", pauses + 1), timeout=30,
                   what="every worker to stop consuming the release queue")  # fmt: skip
        held = create_eligible_holds(30, offerings=2)
        # when: sweeps run
        run_sweeps(shards=2)
        # then: they claim and publish as always...
        wait_until(lambda: min(claim_counts(held).values()) >= 1, timeout=30, what="claims")
        queue = cleanup_settings().release_queue
        wait_until(lambda: queue_stats(queue).depth > 0, timeout=30, what="messages waiting")
        # ...and nothing is released while paused, though each worker had its chances: it
        # went on fetching sweeps sent after the release messages were waiting (a consumer of
        # the release queue would have taken them as well) for three of its polls of the
        # switch (a poll that wrongly resumed would have)
        sweep_until_each_worker_swept(workers, shards=2, span=3 * POLL_INTERVAL_S)
        assert released_count(held) == 0
        assert queue_stats(queue).depth > 0
        # when: resumed, every worker consumes again and the backlog drains
        set_paused(False, "ops", "")
        wait_until(lambda: _all_say(workers, "releases resumed", resumes + 1), timeout=30,
                   what="every worker to consume the release queue again")  # fmt: skip
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="released")
    finally:
        set_paused(False, "ops", "")
