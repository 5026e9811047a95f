"""One meaning of "eligible for release" (held, and past ``expires_at`` by the database clock):
a seeded table of holds in every state, and every reader of eligibility asked which holds it
sees. The ORM queryset, the SQL condition, the backlog reads of the gauges, the health page and
the autoscaler, ``availability``, the burst drill's sample and the claim must all agree.

Break: the burst drill's statement written by hand again without the status test (``expires_at
<= now()`` alone) counts the confirmed and the released hold too: 8, not 6.
"""

from __future__ import annotations

import pytest
from django.db import connection

from cleanup.operations import samples
from cleanup.operations.console.gauges import BacklogCollector
from cleanup.release import claim, delivery_cap
from reservations import services, sql
from reservations.db import rows, scalar
from reservations.eligibility import eligible_sql
from reservations.models import BUCKETS, Reservation
from tools.drills.burst import sample
from tools.drills.state import BurstConfig, BurstState
from tools.seed import seed_holds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("broker")]

SHARDS = 4


def _seed() -> tuple[set[int], float, int]:
    """Eight holds expired 20 to 160 s ago, four expiring in an hour, on one offering; then one
    expired hold confirmed and one released. The eligible ids, the oldest one's age in seconds
    (about), and the offering."""
    expired = seed_holds(8, offerings=1, expires_in=lambda p: -20.0 * (p + 1), name="elig")
    seed_holds(4, offerings=1, expires_in=3600.0, name="later")
    confirmed, released = expired[-1], expired[-2]  # the two oldest
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE reservations_reservation SET status = 'confirmed' WHERE id = %s", [confirmed]
        )
        cur.execute(
            "UPDATE reservations_reservation SET status = 'released', released_version = version,"
            " released_at = now(), release_reason = 'expired' WHERE id = %s",
            [released],
        )
    eligible = set(expired) - {confirmed, released}
    offering = int(
        scalar("SELECT offering_id FROM reservations_reservation WHERE id = %s", [expired[0]])
    )
    return eligible, 20.0 * 6, offering


def test_every_reader_of_eligibility_sees_the_same_holds() -> None:
    eligible, oldest_age, offering = _seed()
    n = len(eligible)
    assert n == 6

    # the ORM and the SQL condition, plain and in the release statement's form
    assert set(Reservation.objects.eligible().values_list("id", flat=True)) == eligible
    assert {
        r[0] for r in rows(f"SELECT id FROM reservations_reservation WHERE {eligible_sql()}")
    } == eligible
    assert {
        r[0]
        for r in rows(
            f"SELECT hold.id FROM reservations_reservation hold "
            f"WHERE {eligible_sql('hold', off_the_held_index=True)}"
        )
    } == eligible

    # the backlog statements (gauges, health page, autoscaler) over every bucket
    all_buckets = list(range(BUCKETS))
    assert scalar(sql.ELIGIBLE_COUNT, [all_buckets, 1000]) == n
    assert oldest_age <= scalar(sql.OLDEST_ELIGIBLE_AGE, [all_buckets]) < oldest_age + 60
    backlog = services.eligible_backlog(all_buckets, cap=1000)
    assert (backlog.eligible, backlog.capped) == (n, False)
    assert oldest_age <= backlog.oldest_age_seconds < oldest_age + 60
    assert services.eligible_backlog(all_buckets, cap=n - 1).capped

    # the health page, shard by shard, and the /metrics gauges
    shards = samples.read_shards(SHARDS, cap=1000)
    assert sum(count for _age, count, _capped in shards) == n
    assert oldest_age <= max(age for age, _count, _capped in shards) < oldest_age + 60
    gauges = BacklogCollector().read_eligible()
    assert sum(value for _shard, value in gauges["eligible_reservations"]) == n
    assert max(value for _shard, value in gauges["oldest_eligible_reservation_age_seconds"]) >= (
        oldest_age
    )

    # availability: the offering's eligible holds count as seats a learner can get
    assert services.availability(offering)["eligible"] == n

    # the burst drill's sample, over the seeded ids
    ids = sorted(r[0] for r in rows("SELECT id FROM reservations_reservation"))
    state = BurstState(ids=ids, tally_minute=delivery_cap.current_minute())
    drill = sample(BurstConfig(shards=SHARDS), state, 0.0, [], count=True)
    assert drill.eligible == n
    assert drill.oldest_eligible_s is not None and drill.oldest_eligible_s >= oldest_age

    # the claim, over every shard: exactly the eligible holds, each once
    claimed = [
        hold.reservation_id
        for shard in range(SHARDS)
        for hold in claim.claim_expired(
            shard, SHARDS, batch_size=100, lease_seconds=60, max_claims=5
        )
    ]
    assert sorted(claimed) == sorted(eligible)
