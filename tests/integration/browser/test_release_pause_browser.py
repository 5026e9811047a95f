"""Pausing releases from the health page in a real browser (Playwright + Debian's chromium), with
the shared fleet of real workers: the page says paused, since when, by whom and why; expired
holds stay held while sweeps publish; "Resume releases" lets the workers drain them. Each change
leaves a history entry."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import LogEntry

from cleanup.broker.readers import queue_depth
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

from .conftest import USERNAME

pytestmark = [pytest.mark.browser]

HEALTH = "/admin/cleanup/health/?workers=0"


def _said(worker: Worker, needle: str) -> int:
    return len(log_lines([worker.log_path], needle))


def test_pausing_and_resuming_releases_from_the_health_page(
    signed_in: Any, live_server: Any, workers: Any, clean: None, shots: Any
) -> None:
    page = signed_in
    release_queue = cleanup_settings().release_queue
    paused = [(w, _said(w, "releases paused")) for w in workers]
    try:
        page.goto(live_server.url + HEALTH)
        assert page.inner_text("#pause-state") == "releases running"
        # when: the operator pauses, saying why
        page.fill("#pause-reason-input", "restoring a backup")
        page.click("#pause-button")
        page.wait_for_selector("#resume-button")
        # then: the page says so, since when and by whom
        assert page.inner_text("#pause-state") == "releases paused"
        assert page.inner_text("#paused-by") == USERNAME
        assert page.inner_text("#pause-reason") == "restoring a backup"
        assert page.inner_text("#paused-since").endswith("UTC")
        page.screenshot(path=str(shots / "health-paused.png"), full_page=True)
        # and the workers hold the releases back while sweeps go on: each has followed the
        # switch...
        wait_until(lambda: all(_said(w, "releases paused") > before for w, before in paused),
                   timeout=30, what="every worker to stop consuming the release queue")  # fmt: skip
        held = create_eligible_holds(20, offerings=2)
        run_sweeps(shards=1)
        wait_until(lambda: min(claim_counts(held).values()) >= 1, timeout=30, what="claims")
        wait_until(lambda: queue_depth(release_queue) > 0, timeout=30, what="messages waiting")
        # ...and had its chances to release them: each went on fetching sweeps sent after the
        # release messages were waiting (a consumer of the release queue would have taken them
        # as well) for three of its polls of the switch (a poll that wrongly resumed would
        # have)
        sweep_until_each_worker_swept(workers, shards=1, span=3 * POLL_INTERVAL_S)
        assert released_count(held) == 0
        # when: resumed from the page
        page.click("#resume-button")
        page.wait_for_selector("#pause-button")
        assert page.inner_text("#pause-state") == "releases running"
        # then: the workers drain the backlog
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="released")
    finally:
        set_paused(False, USERNAME)
    assert list(LogEntry.objects.order_by("pk").values_list("change_message", flat=True)) == [
        "releases: paused (restoring a backup)",
        "releases: resumed",
    ]
