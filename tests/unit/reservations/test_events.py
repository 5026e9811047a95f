"""The events contract (reservations.events): a schema per kind, each a well-formed draft 2020-12
schema that documents every field it names, and the checks that name the field a bad message
gets wrong. That the relay's real messages match the schemas exactly:
tests/unit/cleanup/release/test_outbox.py."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from reservations import events
from reservations.events import InvalidEvent, check_envelope, load_schema, validate
from reservations.models import OutboxEvent

HELD: dict[str, Any] = {
    "schema_version": 1,
    "event_id": 7,
    "kind": "reservation.held",
    "reservation_id": 3,
    "version": 1,
    "payload": {"offering_id": 2, "expires_at": "2030-01-02T03:04:05.678901+00:00"},
    "created_at": "2030-01-02T02:54:05.678901+00:00",
}


def held(**changes: Any) -> dict[str, Any]:
    """A valid reservation.held message with ``changes`` (``payload`` merged, None removes)."""
    message: dict[str, Any] = copy.deepcopy(HELD)
    for name, value in changes.items():
        if name == "payload" and isinstance(value, dict):
            for key, item in value.items():
                if item is None:
                    message["payload"].pop(key)
                else:
                    message["payload"][key] = item
        elif value is None:
            message.pop(name)
        else:
            message[name] = value
    return message


def _properties(schema: dict[str, Any], at: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for name, spec in schema.get("properties", {}).items():
        yield f"{at}{name}", spec
        yield from _properties(spec, f"{at}{name}.")


def test_the_kinds_are_the_outbox_models_kinds() -> None:
    assert events.KINDS == tuple(OutboxEvent.Kind.values)


@pytest.mark.parametrize("kind", events.KINDS)
def test_each_kinds_schema_is_draft_2020_12_and_documents_every_field(kind: str) -> None:
    schema = load_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"urn:reservations:event-schema:{kind}:1"
    assert schema["title"].startswith(f"{kind}: ")
    assert schema["description"]
    assert schema["properties"]["kind"]["const"] == kind
    assert schema["properties"]["schema_version"]["const"] == events.SCHEMA_VERSION
    # the hold's version is not the schema's: each says which it is
    assert "hold" in schema["properties"]["version"]["description"]
    assert "Not the hold's version" in schema["properties"]["schema_version"]["description"]
    for objects in (schema, schema["properties"]["payload"]):
        assert objects["type"] == "object"
        assert objects["required"] == list(objects["properties"])
        # additive fields keep schema_version 1: a consumer of 1 accepts them
        assert objects["additionalProperties"] is True
    undocumented = [name for name, spec in _properties(schema) if not spec.get("description")]
    assert undocumented == []


def test_load_schema_hands_out_a_copy_and_refuses_an_unknown_kind() -> None:
    load_schema("reservation.held")["properties"].clear()
    assert "payload" in load_schema("reservation.held")["properties"]
    with pytest.raises(InvalidEvent, match="kind: 'reservation.lost' is not one of"):
        load_schema("reservation.lost")


def test_a_valid_message_passes_and_a_field_added_later_too() -> None:
    validate(HELD)
    validate(held(trace_id="abc", payload={"seat": "12A"}))


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        ({"payload": {"expires_at": None}}, "payload.expires_at", "missing"),
        ({"created_at": None}, "created_at", "missing"),
        ({"event_id": "7"}, "event_id", "'7' is not a positive integer"),
        ({"event_id": True}, "event_id", "True is not a positive integer"),
        ({"reservation_id": 0}, "reservation_id", "0 is less than the minimum of 1"),
        ({"version": 2}, "version", "1 was expected"),
        ({"payload": {"offering_id": "2"}}, "payload.offering_id", "'2' is not of type"),
        ({"payload": {"expires_at": "2030-13-02T03:04:05+00:00"}}, "payload.expires_at", "date"),
        ({"payload": {"expires_at": "2030-01-02T03:04:05"}}, "payload.expires_at", "date-time"),
        ({"created_at": "yesterday"}, "created_at", "is not a 'date-time'"),
        ({"schema_version": 2}, "schema_version", "2 is not one this consumer knows (1)"),
        ({"schema_version": "1"}, "schema_version", "'1' is not an integer"),
        ({"schema_version": None}, "schema_version", "missing"),
        ({"kind": "reservation.moved"}, "kind", "'reservation.moved' is not one of"),
        ({"payload": "{}"}, "payload", "is not of type 'object'"),
    ],
)
def test_a_bad_message_is_refused_naming_the_field(
    changes: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises(InvalidEvent) as refused:
        validate(held(**changes))
    assert refused.value.field == field
    assert problem in refused.value.problem
    assert str(refused.value).startswith(f"{field}: ")


@pytest.mark.parametrize("message", [[HELD], "event", None, 7])
def test_a_message_that_is_not_an_object_is_refused_as_a_whole(message: Any) -> None:
    with pytest.raises(InvalidEvent, match=r"^\(message\): a JSON \w+, not an object$"):
        validate(message)


def test_the_envelope_check_needs_no_jsonschema_and_validate_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # as if it were not installed
    events._validator.cache_clear()
    try:
        check_envelope(HELD)
        with pytest.raises(InvalidEvent, match="schema_version: 3 is not one this consumer"):
            check_envelope(held(schema_version=3))
        with pytest.raises(ImportError, match=r"needs the jsonschema package \(pip install"):
            validate(HELD)
    finally:
        events._validator.cache_clear()


def test_the_message_the_relay_builds_is_the_envelope_with_the_schema_version() -> None:
    from datetime import UTC, datetime

    built = events.message(
        event_id=7,
        kind="reservation.held",
        reservation_id=3,
        version=1,
        payload={"offering_id": 2, "expires_at": "2030-01-02T03:04:05.678901+00:00"},
        created_at=datetime(2030, 1, 2, 2, 54, 5, 678901, tzinfo=UTC),
    )
    assert built == HELD
    validate(built)
