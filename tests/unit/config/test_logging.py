"""The log formatters (``LOG_FORMAT=text|json``): every ``extra`` field is printed, and an
exception travels with its line."""

from __future__ import annotations

import json
import logging
import sys

from config.logging import JsonFormatter, KeyValueFormatter


def _record(exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord(
        "cleanup.release.sweep", logging.WARNING, __file__, 1, "sweep %s", ("done",), exc_info
    )
    record.shard = 3
    record.trace_id = "t-1"
    return record


def test_json_lines_carry_the_message_level_logger_and_every_extra_field() -> None:
    line = JsonFormatter().format(_record())
    payload = json.loads(line)
    assert "\n" not in line
    assert payload["message"] == "sweep done"
    assert payload["level"] == "WARNING"
    assert payload["logger"] == "cleanup.release.sweep"
    assert (payload["shard"], payload["trace_id"]) == (3, "t-1")
    assert payload["ts"].endswith("+00:00")
    assert "exc" not in payload


def test_a_json_line_keeps_its_exception_as_one_field() -> None:
    line = JsonFormatter().format(_record(exc=True))
    payload = json.loads(line)
    assert "\n" not in line
    assert "ValueError: boom" in payload["exc"]


def test_text_lines_are_key_value_after_the_message() -> None:
    line = KeyValueFormatter().format(_record())
    assert line.split(" ", 1)[1] == "WARNING cleanup.release.sweep sweep done shard=3 trace_id=t-1"
