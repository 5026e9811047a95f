"""The admin's "Cleanup health" page (cleanup.operations.console.health_page): staff only, its
numbers equal to SQL and the broker, an old backlog in red, the last sweep of each shard and of
the adaptive mode, the chart's samples, a hold's search, and the open dead letters against
their cap. (The same page in a real browser: tests/integration/browser/.)"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from cleanup.broker.readers import PEEK_ENTRIES, QueueStats
from cleanup.models import CleanupReceipt, DeadLetter, SweepRecord
from cleanup.operations import samples
from cleanup.operations.console import health
from cleanup.release.messages import ReleaseMessage
from cleanup.release.schedule import install_schedule
from cleanup.release.sweep import SweepResult, record_last_sweep, sweep_shard
from reservations import services
from reservations.db import rows as sql
from tests.support.dead_letters import MALFORMED, UNKNOWN, letter
from tests.support.holds import expired_holds, seed_expired

HEALTH = "cleanup-health"
DEAD_LETTERS = "admin:cleanup_deadletter_changelist"


def metric(html: str, shard: int | None, name: str) -> str:
    """The data-value of ``data-metric=name`` (inside the shard's row when ``shard`` is set)."""
    if shard is not None:
        row = re.search(rf'<tr data-shard="{shard}">(.*?)</tr>', html, re.S)
        assert row, f"no row for shard {shard}"
        html = row.group(1)
    found = re.search(rf'data-metric="{re.escape(name)}"[^>]*data-value="([^"]*)"', html)
    if found:
        return found.group(1)
    cell = re.search(rf'data-metric="{re.escape(name)}"[^>]*>(.*?)</td>', html, re.S)
    assert cell, f"no {name} on the page"
    return re.sub(r"<[^>]+>", "", cell.group(1)).strip()


# --- the health page --------------------------------------------------------------------------


def test_anonymous_users_are_sent_to_the_admin_login(client, db):
    response = client.get(reverse(HEALTH))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_a_non_staff_user_cannot_open_the_health_page(client, db):
    user = User.objects.create_user("learner", password="x")
    client.force_login(user)
    response = client.get(reverse(HEALTH))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_the_admin_index_links_to_the_health_page(root_client):
    html = root_client.get(reverse("admin:index")).content.decode()
    assert f'href="{reverse(HEALTH)}"' in html


def test_the_queue_age_says_empty_or_not_observable_rather_than_a_bare_dash(
    root_client, broker, monkeypatch
):
    # given: an empty release queue on Redis
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then
    assert metric(html, None, "queue-age") == "— (empty)"
    # given: messages waiting on a broker that cannot show their age (RabbitMQ: no peek)
    waiting = QueueStats("cleanup", depth=5, oldest_age_seconds=None, unacked=None)
    monkeypatch.setattr(health, "queue_stats", lambda queue: waiting)
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: the page says why there is no number, and where to look instead
    assert metric(html, None, "queue-depth") == "5"
    assert metric(html, None, "queue-age").startswith("— (not observable on this broker")
    assert "oldest eligible hold" in metric(html, None, "queue-age")


def test_the_queue_age_says_unreadable_when_the_oldest_entries_on_redis_are(root_client, broker):
    # given: the release queue's oldest entries on Redis are all planted garbage
    broker.rpush("cleanup", *([b"not json"] * PEEK_ENTRIES))
    # when
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: not "empty", not "RabbitMQ has no peek"
    assert metric(html, None, "queue-depth") == str(PEEK_ENTRIES)
    assert metric(html, None, "queue-age").startswith(
        f"— (the oldest waiting entries are unreadable: {PEEK_ENTRIES} skipped"
    )


def test_the_health_page_numbers_equal_sql_and_the_broker(root_client, broker, make_offering):
    # given: a backlog in a 4-shard schedule, messages waiting, dead letters, receipts
    install_schedule(shards=4, every=10)
    offering = make_offering(capacity=60)
    expired_holds(30, offering_id=offering.pk, ago=timedelta(seconds=400))
    services.hold_seat(offering.pk, "still-valid", ttl_seconds=600)
    letters = [
        DeadLetter.objects.create(reason=DeadLetter.Reason.MALFORMED),
        DeadLetter.objects.create(reason=DeadLetter.Reason.MALFORMED),
        DeadLetter.objects.create(reason=DeadLetter.Reason.RETRIES_EXHAUSTED),
    ]
    DeadLetter.objects.filter(pk=letters[2].pk).update(resolved_at="2026-01-01T00:00Z")
    CleanupReceipt.objects.create(
        idempotency_key="release:1:1", reservation_id=1, version=1, outcome="released", attempt=3
    )
    CleanupReceipt.objects.create(
        idempotency_key="release:2:1", reservation_id=2, version=1, outcome="renewed"
    )
    from cleanup.release.publish import publish_release_messages

    publish_release_messages(
        [ReleaseMessage.for_hold(900_000 + i, 1, timezone.now(), 0, "t") for i in range(7)]
    )
    # when
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: per shard, what SQL says (an independent statement: bucket % N)
    for k in range(4):
        n, oldest = sql(
            "SELECT count(*), EXTRACT(EPOCH FROM now() - min(expires_at)) "
            "FROM reservations_reservation WHERE status = 'held' AND expires_at <= now() "
            "AND bucket %% 4 = %s",
            [k],
        )[0]
        assert int(metric(html, k, "eligible")) == n
        if n:
            assert abs(float(metric(html, k, "oldest-age")) - float(oldest)) < 5
        else:
            assert float(metric(html, k, "oldest-age")) == 0.0
    total = sum(int(metric(html, k, "eligible")) for k in range(4))
    assert total == 30
    # the broker's own answer for the release queue
    depth = sum(broker.llen(key) for key in broker.keys("cleanup*") if broker.type(key) == b"list")
    assert int(metric(html, None, "queue-depth")) == depth == 7
    # open dead letters by reason, linking to the filtered list
    assert metric(html, None, "dead-open-malformed") == "2"
    assert "dead-open-retries_exhausted" not in html
    assert f"{reverse(DEAD_LETTERS)}?reason=malformed&amp;resolved=no" in html
    # outcomes and retries from receipts
    assert metric(html, None, "transitions-5") == "1"
    assert metric(html, None, "retries-60") == "2"
    assert metric(html, None, "outcome-renewed-60") == "1"
    assert metric(html, None, "outcome-released-5") == "1"
    assert metric(html, None, "beat_lock").startswith("nobody")


def test_an_old_backlog_shows_red_and_a_capped_count_says_so(
    root_client, broker, make_offering, settings
):
    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 5
    settings.CLEANUP_SLO_SECONDS = 300
    install_schedule(shards=1, every=10)
    expired_holds(8, offering_id=make_offering(capacity=20).pk, ago=timedelta(seconds=900))
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert metric(html, 0, "eligible") == "5"
    assert "capped at 5" in html
    assert 'class="state state-red" id="overall-state"' in html


def test_the_last_sweep_of_each_shard_is_shown(root_client, broker):
    install_schedule(shards=2, every=10)
    result = SweepResult(1, 2, "trace-x", claimed=12, published=11, backpressure=True)
    record_last_sweep(result)
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert metric(html, 1, "claimed") == "12"
    assert metric(html, 1, "published") == "11"
    assert metric(html, 1, "backpressure").startswith("yes")
    assert SweepRecord.objects.get(shard=1).published == 11


# A page that waited for an answer that never comes would be stuck: this test's own deadline
# (pytest-timeout) fails it, with no timed assertion.
@pytest.mark.timeout(60)
def test_the_worker_ping_is_bounded_when_no_worker_answers(root_client, broker):
    html = root_client.get(reverse(HEALTH)).content.decode()
    assert "none answered" in html


def test_samples_feed_the_chart_and_are_pruned_after_a_day(root_client, broker, make_offering):
    from datetime import timedelta

    from django.utils import timezone

    from cleanup.models import HealthSample

    install_schedule(shards=2, every=10)
    expired_holds(3, offering_id=make_offering(capacity=5).pk, ago=timedelta(seconds=120))
    sample = samples.take_sample()
    assert sample.eligible == 3
    assert 110 < sample.oldest_eligible_age_seconds < 200
    assert sample.queue_depth == 0
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert "Last hour (1 samples)" in html
    assert html.count('class="health-chart"') == 3
    old = HealthSample.objects.create(
        taken_at=timezone.now() - timedelta(days=2),
        oldest_eligible_age_seconds=0,
        eligible=0,
        released_last_minute=0,
    )
    assert samples.prune_samples() == 1
    assert not HealthSample.objects.filter(pk=old.pk).exists()


def test_searching_a_hold_id_on_the_health_page_opens_the_hold(root_client, offering):
    hold = services.hold_seat(offering.pk, "someone", ttl_seconds=60)
    response = root_client.get(reverse(HEALTH) + f"?hold={hold.pk}&workers=0")
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:reservations_reservation_change", args=[hold.pk])
    missing = root_client.get(reverse(HEALTH) + "?hold=999999&workers=0", follow=True)
    assert "No hold with id" in missing.content.decode()


# --- open dead letters and the last sweep -----------------------------------------------------


def test_the_health_pages_open_counts_link_to_the_filtered_list_and_show_the_cap(
    root_client, settings
):
    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 3
    client = root_client
    letter(MALFORMED), letter(MALFORMED), letter(UNKNOWN, "x")
    html = client.get(reverse("cleanup-health") + "?workers=0").content.decode()
    cell = html.split('data-metric="dead-open-malformed">', 1)[1].split("</td>", 1)[0]
    assert f'<a href="{reverse(DEAD_LETTERS)}?reason=malformed&amp;resolved=no"' in cell
    assert ">2</a>" in cell
    total = html.split('data-metric="dead-open-total">', 1)[1].split("</td>", 1)[0]
    assert "cap reached" in total and ">3</a> of 3" in total


@pytest.mark.django_db(transaction=True)
def test_the_last_sweep_shows_messages_and_holds_on_the_health_page(adaptive, broker, admin_client):

    seed_expired(1_000, seconds_ago=1, offerings=2)
    result = sweep_shard(0, 1, batch_size=500)
    record_last_sweep(result)
    page = admin_client.get("/admin/cleanup/health/").content.decode()
    assert f'data-metric="published">{result.published}<' in page
    assert f'data-metric="messages">{result.messages}<' in page
    assert f"up to {result.largest_message} ({result.sizing_reason})" in page
