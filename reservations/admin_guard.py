"""Guards for admin actions that change state: a confirmation page first, a bound on how many
rows one click may touch, and an admin ``LogEntry`` per row acted on.

An action calls ``confirmation`` when the POST does not carry ``confirm=yes``; the page lists
what will happen and re-posts the same action with ``confirm=yes`` and the ids it showed (at
most the bound) in one field, ``confirm_ids``: one form field per id would pass Django's
``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (1,000) at the bound and be refused with a 400. The re-post
selects across the list's current filter, and ``bounded_ids`` keeps only the confirmed ids
that still match it. "Select all N matching the filter" (``select_across``) is accepted and
bounded: the page says how many match and that only the first ``limit`` by id will be acted on.
A confirmation may also ask for text (``ConfirmInput``, e.g. why); when the answer is not
acceptable the action shows the page again with the error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

CONFIRM_FIELD = "confirm"
CONFIRM_IDS_FIELD = "confirm_ids"
SHOWN_IDS = 20


@dataclass(frozen=True)
class ConfirmInput:
    """A text the confirmation page asks for (a textarea posted with the confirmation)."""

    name: str
    label: str
    value: str = ""
    error: str = ""
    help: str = ""
    maxlength: int = 500


def confirmed(request: HttpRequest) -> bool:
    return request.POST.get(CONFIRM_FIELD) == "yes"


def select_across(request: HttpRequest) -> bool:
    return request.POST.get("select_across") == "1"


def confirmed_ids(request: HttpRequest, limit: int) -> list[int] | None:
    """The ids a confirmation page showed (``confirm_ids``), at most ``limit``; None when the
    POST is not such a confirmation."""
    if not confirmed(request) or CONFIRM_IDS_FIELD not in request.POST:
        return None
    tokens = request.POST[CONFIRM_IDS_FIELD].split(",")
    return [int(t) for t in tokens[:limit] if t.strip().isdigit()]


def bounded_ids(
    queryset: QuerySet[Any], limit: int, request: HttpRequest | None = None
) -> tuple[list[int], int | None]:
    """The first ``limit`` ids (ascending) and the number matching when that is more
    (None when all of them fit). On a confirmation's re-post (``request``), only the ids the
    page showed that still match."""
    shown = confirmed_ids(request, limit) if request is not None else None
    if shown is not None:
        queryset = queryset.filter(pk__in=shown)
    ids = list(queryset.order_by("pk").values_list("pk", flat=True)[: limit + 1])
    if len(ids) <= limit:
        return ids, None
    return ids[:limit], queryset.count()


@dataclass(frozen=True)
class Selection:
    """What one click acts on: the first ``limit`` ids, and how many matched when that is more
    (None when all of them fit); the confirmation page shows all three."""

    ids: list[int]
    matching: int | None
    limit: int


def bounded_selection(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    limit: int,
    *,
    what: str,
    done: str,
) -> Selection | None:
    """The action's selection (``bounded_ids``), or None after telling the user when a
    hand-made selection exceeds ``limit`` (``refuse_oversized_selection``)."""
    ids, matching = bounded_ids(queryset, limit, request)
    if refuse_oversized_selection(modeladmin, request, matching, limit, what=what, done=done):
        return None
    return Selection(ids, matching, limit)


def refuse_oversized_selection(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    matching: int | None,
    limit: int,
    *,
    what: str,
    done: str,
) -> bool:
    """True, after telling the user, when an explicit selection exceeds ``limit``: "all N
    matching the filter" is bounded (the confirmation page says so), a larger hand-made
    selection is refused."""
    if matching is None or select_across(request):
        return False
    modeladmin.message_user(
        request, f"Select at most {limit} {what} at a time; nothing was {done}.", messages.ERROR
    )
    return True


def confirmation(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    selection: Selection,
    *,
    action: str,
    title: str,
    verb: str,
    breakdown: Iterable[tuple[str, int]],
    breakdown_title: str,
    note: str = "",
    inputs: Sequence[ConfirmInput] = (),
) -> TemplateResponse:
    opts = modeladmin.model._meta
    ids = selection.ids
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "opts": opts,
        "action": action,
        "verb": verb,
        "ids": list(ids),
        "ids_field": ",".join(str(pk) for pk in ids),
        "confirm_ids_field": CONFIRM_IDS_FIELD,
        "inputs": list(inputs),
        "input_errors": [i.error for i in inputs if i.error],
        "shown_ids": list(ids[:SHOWN_IDS]),
        "more_ids": max(0, len(ids) - SHOWN_IDS),
        "matching": selection.matching,
        "limit": selection.limit,
        "breakdown": list(breakdown),
        "breakdown_title": breakdown_title,
        "note": note,
        "confirm_field": CONFIRM_FIELD,
        "back_url": request.get_full_path(),
        "change_url_name": f"admin:{opts.app_label}_{opts.model_name}_change",
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/confirm_action.html", context)


def log_each(request: HttpRequest, objects_by_result: dict[str, list[Any]], what: str) -> None:
    """One CHANGE ``LogEntry`` per object acted on: who (the request's user), when (now), what
    (``"<what>: <result>"``)."""
    log_rows(request.user.pk or 0, objects_by_result, what)


def log_rows(user_id: int, objects_by_result: dict[str, list[Any]], what: str) -> None:
    """``log_each`` for a given user id (a management command's operator)."""
    for result, objects in objects_by_result.items():
        if objects:
            LogEntry.objects.log_actions(
                user_id=user_id,
                queryset=objects,
                action_flag=CHANGE,
                change_message=f"{what}: {result}",
            )


class ReadOnly:
    """Inspect only: no add, change or delete through the admin (every state change goes
    through the services and the guarded actions). Mix into a ``ModelAdmin`` or an inline.

    Every name in ``fields`` is read-only, display methods included: a name in ``fields`` that
    is not a model field must be read-only, or Django cannot build the page's form."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        declared = getattr(self, "fields", None) or getattr(self, "readonly_fields", None)
        return tuple(declared or ())

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
