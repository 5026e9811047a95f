"""The soak drill's verdicts (bench/soak_analysis.py) on made-up series: what counts as grown
in the second half, and the half and end values of report.json. No process, nothing timed."""

from __future__ import annotations

from bench import soak_analysis as analysis
from bench.soak import retention_seconds, soak_settings


def saw_tooth(end: float, base: float, tooth: float, period: float, drift: float = 0.0):
    """A retained table under bursts: ``tooth`` rows arrive at the start of every ``period`` s
    and leave half a period later, on top of ``base``, plus ``drift`` rows a second."""
    return [
        (float(t), base + (tooth if t % period < period / 2 else 0.0) + drift * t)
        for t in range(0, int(end) + 1, 10)
    ]


def test_a_flat_saw_tooth_has_not_grown_wherever_the_run_ends() -> None:
    for end in (3600.0, 3500.0, 3300.0):
        series = saw_tooth(end, base=5000, tooth=2000, period=300)
        verdict = analysis.growth(series, end, analysis.ROWS)
        assert not verdict.grew, (end, verdict)


def test_a_table_that_keeps_growing_has_grown() -> None:
    # one row a second more: 900 rows between the quarters' middles, on a base of 5,000
    series = saw_tooth(3600.0, base=5000, tooth=2000, period=300, drift=1.0)
    verdict = analysis.growth(series, 3600.0, analysis.ROWS)
    assert verdict.grew
    assert verdict.change is not None and 850 < verdict.change < 950, verdict


def test_growth_below_the_absolute_floor_is_noise() -> None:
    # a process gaining 2 MiB on 40 (5 %: 2 MiB) stays under the 3 MiB floor
    series = [(float(t), 40.0 + (2.0 if t >= 2700 else 0.0)) for t in range(0, 3601, 10)]
    assert not analysis.growth(series, 3600.0, analysis.RSS).grew
    # 8 MiB on 40 is growth
    series = [(float(t), 40.0 + (8.0 if t >= 2700 else 0.0)) for t in range(0, 3601, 10)]
    assert analysis.growth(series, 3600.0, analysis.RSS).grew


def test_a_series_from_zero_has_no_relative_change_but_can_grow() -> None:
    series = [(float(t), 0.0 if t < 2700 else 100.0) for t in range(0, 3601, 10)]
    verdict = analysis.growth(series, 3600.0, analysis.ROWS)
    assert (verdict.relative, verdict.grew) == (None, True)


def test_a_run_too_short_for_both_quarters_judges_nothing() -> None:
    verdict = analysis.growth([(0.0, 1.0), (10.0, 2.0)], 3600.0, analysis.ROWS)
    assert (verdict.grew, verdict.samples, verdict.third_quarter_mean) == (False, 0, None)


def test_the_half_and_end_values_are_the_last_samples_at_or_before_them() -> None:
    series = [(0.0, 1.0), (10.0, 2.0), (20.0, 3.0)]
    assert analysis.value_at(series, 15.0) == 2.0
    assert analysis.value_at(series, 20.0) == 3.0
    assert analysis.value_at(series, -1.0) == 1.0
    assert analysis.value_at([], 5.0) is None


def test_judge_names_what_grew_by_kind() -> None:
    flat = [(float(t), 10.0) for t in range(0, 3601, 10)]
    rising = [(float(t), float(t)) for t in range(0, 3601, 10)]
    judged = analysis.judge(
        {
            "rows": (analysis.ROWS, {"a": flat, "b": rising}),
            "rss_mib": (analysis.RSS, {"web": flat}),
        },
        3600.0,
    )
    assert analysis.grown(judged) == ["rows:b"]
    assert judged["rows"]["a"]["threshold"] == {"relative": 0.1, "absolute": 50.0}


def test_the_soak_keeps_receipts_a_sixth_of_the_run_and_longer_than_its_lease() -> None:
    assert (retention_seconds(60), retention_seconds(5), retention_seconds(240)) == (600, 120, 600)
    chosen = soak_settings(60)
    assert chosen["CLEANUP_RETENTION_DAYS"] == 600 / 86400
    # the settings object accepts them: the retention outlasts the lease and visibility timeout
    from cleanup.conf import CleanupSettings

    CleanupSettings(
        retention_days=float(chosen["CLEANUP_RETENTION_DAYS"]),  # type: ignore[arg-type]
        lease_seconds=int(chosen["CLEANUP_LEASE_SECONDS"]),  # type: ignore[call-overload]
    )
    assert chosen["CELERY_WORKER_SEND_TASK_EVENTS"] is True  # as deployed: Flower needs them
