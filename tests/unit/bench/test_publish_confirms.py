"""The publisher-confirms benchmark's arithmetic and table (bench/publish_confirms.py), on made-up
samples: no broker, nothing timed."""

from __future__ import annotations

from bench.publish_confirms import compare, format_table, summarize, table_rows


def test_a_summary_gives_the_median_the_nearest_rank_p90_and_the_median_per_message() -> None:
    summary = summarize([float(ms) for ms in (10, 1, 9, 2, 8, 3, 7, 4, 6, 5)], messages=4)
    assert summary == {
        "rounds": 10,
        "median_ms": 5.5,
        "p90_ms": 9.0,
        "min_ms": 1.0,
        "ms_per_message": 1.375,
    }
    assert summarize([3.0], messages=1)["p90_ms"] == 3.0


def test_the_ratio_is_confirmed_over_unconfirmed_of_the_medians_and_of_each_rounds_pair() -> None:
    samples = {"confirmed": [30.0, 20.0, 90.0], "unconfirmed": [10.0, 10.0, 60.0]}
    measured = compare(samples, messages=10, holds=500)
    assert (measured["confirmed"]["median_ms"], measured["unconfirmed"]["median_ms"]) == (30, 10)
    assert measured["ratio"] == 3.0
    assert measured["paired_ratio_median"] == 2.0  # rounds: 3.0, 2.0, 1.5
    assert (measured["messages"], measured["holds"]) == (10, 500)


def test_the_table_has_a_row_per_case_and_batch_and_says_why_a_case_did_not_run() -> None:
    batch = compare({"confirmed": [12.0], "unconfirmed": [4.0]}, messages=500, holds=500)
    rows = table_rows(
        {
            "classic": {"kinds": {"per_hold": batch}},
            "cluster": {"skipped": "rabbitmq-server is missing"},
        }
    )
    assert rows == [
        (
            "machine node, classic queues",
            "500 messages x 1 hold",
            "12.0 / 12.0 ms",
            "4.0 / 4.0 ms",
            "3.00",
            "0.024",
            "0.008",
        ),
        (
            "3-node cluster, quorum queues",
            "-",
            "SKIPPED: rabbitmq-server is missing",
            "",
            "",
            "",
            "",
        ),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 3
    # the columns line up: each row's batch column starts where the header's does
    column = lines[0].index("batch")
    assert lines[1][column:].startswith("500 messages") and lines[2][column:].startswith("-")
