"""One reading of the eligible backlog per interval for the whole fleet
(cleanup.operations.console.backlog_reading): the first scrape after the interval reads and
stores it under a lease, every other scrape of every web process exports it with its age; a
scrape that finds the lease taken exports the older reading; a failed reading gives the lease
back; a change of the shard count or the count cap is read at once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from cleanup.models import BacklogReading
from cleanup.operations.console.gauges import BacklogCollector
from tests.support.fleet import create_eligible_holds
from tests.support.metrics import age_the_reading

pytestmark = [pytest.mark.usefixtures("broker"), pytest.mark.django_db]


def scrape(collector: BacklogCollector) -> tuple[dict[str, float], int]:
    """One scrape of a web process's collector: its eligible gauges (shard 0, and the reading's
    age) and how many backlog statements it ran (one index probe per bucket set, per shard)."""
    with CaptureQueriesContext(connection) as queries:
        families = {m.name: m for m in collector.collect()}
    reads = sum("LIMIT 1) oldest" in q["sql"] for q in queries.captured_queries)

    def value(name: str) -> float:
        return families[f"reservation_cleanup_{name}"].samples[0].value

    gauges = {
        "oldest": value("oldest_eligible_reservation_age_seconds"),
        "eligible": value("eligible_reservations"),
        "age": value("eligible_reading_age_seconds"),
    }
    return gauges, reads


def test_one_scrape_of_the_fleet_reads_the_backlog_and_every_other_exports_it() -> None:
    # given: two web processes, and 5 holds eligible for 100 s
    create_eligible_holds(5, offerings=1, expired_seconds_ago=100)
    web_a, web_b = BacklogCollector(), BacklogCollector()
    # when: both are scraped within the interval
    a, reads_a = scrape(web_a)
    b, reads_b = scrape(web_b)
    # then: the first read the backlog, the second exported that reading
    assert (reads_a, reads_b) == (1, 0)
    assert a["eligible"] == b["eligible"] == 5 and a["oldest"] == b["oldest"] >= 100
    assert a["age"] == 0 and 0 <= b["age"] < 5
    # when: 3 more holds become eligible, inside the interval
    create_eligible_holds(3, offerings=1, expired_seconds_ago=50)
    b, reads_b = scrape(web_b)
    # then: the reading is not taken again (the gauges are up to the interval old)
    assert (b["eligible"], reads_b) == (5, 0)
    # when: the interval has passed
    age_the_reading(10)
    b, reads_b = scrape(web_b)
    a, reads_a = scrape(web_a)
    # then: the next scrape, of either process, reads again for both
    assert (b["eligible"], reads_b) == (8, 1)
    assert (a["eligible"], reads_a, a["oldest"]) == (8, 0, b["oldest"])


def test_a_scrape_that_finds_the_lease_taken_exports_the_older_reading_with_its_age() -> None:
    create_eligible_holds(5, offerings=1, expired_seconds_ago=100)
    web = BacklogCollector()
    scrape(web)
    create_eligible_holds(3, offerings=1, expired_seconds_ago=50)
    # given: another process took the lease for the next reading and is still reading
    age_the_reading(30)
    BacklogReading.objects.update(lease_until=Now() + timedelta(seconds=20))
    # when
    gauges, reads = scrape(web)
    # then: the older reading, its age showing it
    assert (gauges["eligible"], reads) == (5, 0)
    assert gauges["age"] >= 30
    # when: that lease ends without a reading (its process was killed)
    BacklogReading.objects.update(lease_until=Now() - timedelta(seconds=1))
    gauges, reads = scrape(web)
    # then: the next scrape reads
    assert (gauges["eligible"], reads, gauges["age"]) == (8, 1, 0)


@pytest.mark.django_db(transaction=True)
def test_a_failed_reading_gives_the_lease_back_and_the_next_scrape_reads(settings: Any) -> None:
    create_eligible_holds(5, offerings=1, expired_seconds_ago=100)
    web = BacklogCollector()
    scrape(web)
    create_eligible_holds(3, offerings=1, expired_seconds_ago=50)
    age_the_reading(10)
    # given: another session locks the holds, so the reading's statements time out
    settings.METRICS_STATEMENT_TIMEOUT_MS = 50
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with other.cursor() as cur:
            other.set_autocommit(False)
            cur.execute("LOCK TABLE reservations_reservation IN ACCESS EXCLUSIVE MODE")
            # when
            gauges, _ = scrape(web)
            # then: the last good values, the section failed, the lease given back
            assert gauges["eligible"] == 5
            assert web._failed["eligible"] is True
            assert BacklogReading.objects.get().lease_until is None
            other.rollback()
    finally:
        other.close()
    # and: the next scrape reads
    gauges, reads = scrape(web)
    assert (gauges["eligible"], reads, web._failed["eligible"]) == (8, 1, False)


def test_another_shard_count_or_count_cap_is_read_at_once(settings: Any) -> None:
    from cleanup.release.schedule import install_schedule

    create_eligible_holds(20, offerings=1, expired_seconds_ago=100)
    web = BacklogCollector()
    install_schedule(1, 10)
    assert scrape(web)[0]["eligible"] == 20
    # when: the count cap changes inside the interval
    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 7
    gauges, reads = scrape(web)
    # then
    assert (gauges["eligible"], reads) == (7, 1)
    # when: the schedule changes to 4 shards
    install_schedule(4, 10)
    with CaptureQueriesContext(connection) as queries:
        families = {m.name: m for m in web.collect()}
    # then: every shard is read, now
    shards = families["reservation_cleanup_eligible_reservations"].samples
    assert sorted(s.labels["shard"] for s in shards) == ["0", "1", "2", "3"]
    assert sum(s.value for s in shards) == 20
    assert sum("LIMIT 1) oldest" in q["sql"] for q in queries.captured_queries) == 4
