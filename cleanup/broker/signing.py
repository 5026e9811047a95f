"""Signatures on the release messages the project publishes, so that a worker trusts and counts
only what the project itself sent.

Anyone who can write to the broker can put a release message for a real hold in a queue, or in
kombu's ``unacked`` hash for the restore to bring back. Each counted delivery spends the hold's
``CLEANUP_MAX_DELIVERIES`` budget: planted copies used it up and the hold's genuine redelivery
after a crash became a ``deliveries_exhausted`` dead letter. Every release message the project
publishes (``cleanup.release.publish``, ``CleanupTask.retry``) carries a keyed signature in the
``cleanup_signature`` header: an HMAC-SHA256, with a key derived from Django's ``SECRET_KEY``
(``salted_hmac``), over the message's identity (task id, task name and a digest of its
arguments). The worker's consumer verifies it before the message runs, and the Redis restore
before it counts a redelivery; a release message without a valid one is an ``unsigned`` dead
letter that names no hold and is never counted. ``SECRET_KEY_FALLBACKS`` verify too, so the key
can be rotated without refusing messages already queued.

Docs: docs/HARDENING.md, "The delivery budget counts only what made a redelivery".
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from django.conf import settings
from django.utils.crypto import constant_time_compare, salted_hmac
from kombu.utils.json import loads

from cleanup.wire import RELEASE_BATCH_TASK, RELEASE_TASK

SIGNATURE_HEADER = "cleanup_signature"
# The tasks whose messages must be signed: the ones that release holds.
SIGNED_TASKS = frozenset({RELEASE_TASK, RELEASE_BATCH_TASK})
# Keeps this key apart from every other use of SECRET_KEY (sessions, tokens, …).
_SALT = "cleanup.broker.signing.release-message"


def _identity(task_id: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        [list(args), dict(kwargs)], sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()
    return f"{task_id}\n{name}\n{digest}"


def _signature(identity: str, secret: Any) -> str:
    return salted_hmac(_SALT, identity, secret=secret, algorithm="sha256").hexdigest()


def sign(task_id: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> str:
    """The signature of a task message with this id, name and arguments."""
    return _signature(_identity(task_id, name, args, kwargs or {}), settings.SECRET_KEY)


def signed_headers(
    task_id: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The header to publish a release message with."""
    return {SIGNATURE_HEADER: sign(task_id, name, args, kwargs)}


def verify(signature: Any, task_id: Any, name: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``signature`` is the project's for this message (constant-time comparison,
    ``SECRET_KEY`` then each of ``SECRET_KEY_FALLBACKS``)."""
    if not (
        isinstance(signature, str)
        and isinstance(task_id, str)
        and isinstance(name, str)
        and isinstance(args, list | tuple)
        and isinstance(kwargs, dict | None)
    ):
        return False
    try:
        identity = _identity(task_id, name, args, kwargs or {})
    except (TypeError, ValueError):  # arguments JSON cannot hold were never signed
        return False
    secrets = [settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])]
    return any(constant_time_compare(_signature(identity, s), signature) for s in secrets)


def problem(headers: Mapping[str, Any], name: str, args: Any, kwargs: Any) -> str | None:
    """Why a task message of ``name`` may not be trusted, or ``None``: a release message must
    carry the project's signature; other tasks are not signed."""
    if name not in SIGNED_TASKS:
        return None
    signature = headers.get(SIGNATURE_HEADER)
    if signature is None:
        return "release message is not signed by the project's publisher"
    if not verify(signature, headers.get("id"), name, args, kwargs):
        return "release message's signature does not match its id, task and arguments"
    return None


def envelope_is_signed(envelope: Any) -> bool:
    """Whether a kombu Redis envelope (a list entry, or the message of an ``unacked`` entry) is
    a release message the project signed; never raises."""
    try:
        headers = envelope["headers"]
        args, kwargs, _embed = loads(base64.b64decode(envelope["body"]))
        name = headers["task"]
        return name in SIGNED_TASKS and problem(headers, name, args, kwargs) is None
    except Exception:  # noqa: BLE001 - anything unreadable is not signed
        return False
