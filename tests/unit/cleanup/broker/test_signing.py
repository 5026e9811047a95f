"""Release-message signatures (cleanup.broker.signing): only the project's publisher makes them,
and they bind the message's id, task and arguments."""

from __future__ import annotations

from typing import Any

from cleanup.broker import signing
from cleanup.wire import RELEASE_TASK, SWEEP_TASK
from tests.support.wire import release_message

ARGS = [release_message(rid=7)]


def test_a_signature_verifies_only_for_the_message_it_was_made_for() -> None:
    signature = signing.sign("id-1", RELEASE_TASK, ARGS, {})
    assert signing.verify(signature, "id-1", RELEASE_TASK, ARGS, {})
    assert signing.verify(signature, "id-1", RELEASE_TASK, tuple(ARGS), None)  # as decoded
    assert not signing.verify(signature, "id-2", RELEASE_TASK, ARGS, {})
    assert not signing.verify(signature, "id-1", "cleanup.release_batch", ARGS, {})
    assert not signing.verify(signature, "id-1", RELEASE_TASK, [release_message(rid=8)], {})
    assert not signing.verify(signature.upper(), "id-1", RELEASE_TASK, ARGS, {})
    assert not signing.verify(None, "id-1", RELEASE_TASK, ARGS, {})


def test_only_the_secret_key_or_its_fallbacks_make_a_valid_signature(settings: Any) -> None:
    previous = settings.SECRET_KEY
    old = signing.sign("id-1", RELEASE_TASK, ARGS, {})
    # when: the key is rotated
    settings.SECRET_KEY = "another-" + "k" * 60
    assert not signing.verify(old, "id-1", RELEASE_TASK, ARGS, {})
    # then: messages signed with the previous key verify while it is a fallback
    settings.SECRET_KEY_FALLBACKS = ["not-it", previous]
    assert signing.verify(old, "id-1", RELEASE_TASK, ARGS, {})


def test_a_release_message_needs_the_signature_and_other_tasks_do_not() -> None:
    assert "not signed" in str(signing.problem({"id": "id-1"}, RELEASE_TASK, ARGS, {}))
    headers = {"id": "id-1", signing.SIGNATURE_HEADER: "0" * 64}
    assert "does not match" in str(signing.problem(headers, RELEASE_TASK, ARGS, {}))
    headers.update(signing.signed_headers("id-1", RELEASE_TASK, ARGS))
    assert signing.problem(headers, RELEASE_TASK, ARGS, {}) is None
    assert signing.problem({"id": "id-1"}, SWEEP_TASK, [], {"shard": 0}) is None
