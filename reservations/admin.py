"""Admin for inspecting offerings, holds and the outbox.

Holds change state only through ``reservations.services``: the admin cannot add, edit or
delete them; its one write is the "Release expired holds now" action, which calls
``services.release_if_expired`` exactly as the cleanup does.

Another app shows more on a hold's page through ``add_reservation_section`` (the cleanup adds the
hold's receipts and dead letters, its delivery count and its story) instead of registering an
admin of its own for ``Reservation``: this module registers the one ``ReservationAdmin``, the
sections are read per request, and so the page is the same whichever app's admin module Django
imports first (the order of INSTALLED_APPS). The domain still never imports the cleanup.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.contrib import admin, messages
from django.db import DatabaseError
from django.db.models import (
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Now
from django.forms import ModelForm
from django.http import HttpRequest
from django.template.response import TemplateResponse

from reservations import admin_guard

from . import clients, services
from .errors import ReservationError
from .models import ELIGIBLE, ApiClient, ApiToken, Offering, OutboxEvent, Reservation
from .retry import call_with_retries, is_transient_db_error

logger = logging.getLogger(__name__)

# The release action runs in the request; bound the work one click can start.
ADMIN_RELEASE_LIMIT = 1000
# Tokens one click issues or revokes.
ADMIN_TOKEN_LIMIT = 100
MAX_ID = 2**63 - 1
EMPTY = "—"


def human_duration(delta: timedelta) -> str:
    """``timedelta(days=1, hours=2, minutes=3)`` -> ``"1d 2h"``: the two largest units."""
    seconds = max(int(delta.total_seconds()), 0)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (seconds, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2])


def _as_id(term: str) -> int | None:
    """A search term that names a row id ("42" or "#42"), else None."""
    term = term.strip().removeprefix("#")
    if term.isascii() and term.isdigit() and 0 < int(term) <= MAX_ID:
        return int(term)
    return None


@dataclass(frozen=True)
class ReservationSection:
    """A read-only field another app adds to every hold's admin page: ``render`` gets the hold
    and returns text or HTML (``format_html``); ``label`` is the field's label. Shown above the
    hold's own fields when ``above``, below them otherwise, in the order added."""

    name: str
    label: str
    render: Callable[[Reservation], str]
    above: bool = False


_reservation_sections: dict[str, ReservationSection] = {}


def add_reservation_section(section: ReservationSection) -> None:
    """Show ``section`` on every hold's page from the next request on. Its name must not be a
    field or attribute of ``ReservationAdmin``; adding a section of the same name again
    replaces it (an admin module imported twice adds each of its sections once)."""
    if section.name in ReservationAdmin.fields or hasattr(ReservationAdmin, section.name):
        raise ValueError(f"hold section {section.name!r} would hide ReservationAdmin's own")
    _reservation_sections[section.name] = section


def reservation_sections() -> list[ReservationSection]:
    return list(_reservation_sections.values())


def _count_per_offering(holds: QuerySet[Reservation]) -> Coalesce:
    """A correlated COUNT per offering row: computed only for the rows on the page, and served
    by the partial index ``reservations_offering_held_idx``."""
    counts = (
        holds.filter(offering=OuterRef("pk"))
        .order_by()
        .values("offering")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(counts, output_field=IntegerField()), Value(0))


@admin.register(Offering)
class OfferingAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "capacity", "seats_available", "held_count", "eligible_count")
    list_display_links = ("id", "name")
    search_fields = ("name",)
    ordering = ("-id",)
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Offering]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                held_count=_count_per_offering(Reservation.objects.held()),
                eligible_count=_count_per_offering(Reservation.objects.eligible()),
            )
        )

    @admin.display(description="held", ordering="held_count")
    def held_count(self, obj: Offering) -> int:
        return int(getattr(obj, "held_count", 0))

    @admin.display(description="eligible (expired, held)", ordering="eligible_count")
    def eligible_count(self, obj: Offering) -> int:
        return int(getattr(obj, "eligible_count", 0))

    def get_fields(self, request: HttpRequest, obj: Offering | None = None) -> list[Any]:
        if obj is None:
            return ["name", "capacity"]
        return ["name", "capacity", "seats_available", "held_count", "eligible_count", "created_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Offering | None = None) -> list[str]:
        if obj is None:
            return []
        # Capacity and seats are the services' (capacity == seats_available + held + confirmed).
        return ["capacity", "seats_available", "held_count", "eligible_count", "created_at"]

    def save_model(
        self, request: HttpRequest, obj: Offering, form: ModelForm, change: bool
    ) -> None:
        if change:
            # Only the name: a full-row save would write back a stale seats_available.
            obj.save(update_fields=["name"])
            return
        created = services.create_offering(obj.name, obj.capacity)
        obj.pk = created.pk
        obj.seats_available = created.seats_available
        obj.created_at = created.created_at

    def has_delete_permission(self, request: HttpRequest, obj: Offering | None = None) -> bool:
        return False


class ExpiredButHeldFilter(admin.SimpleListFilter):
    """Holds the cleanup should have released: ``Reservation.objects.eligible()``."""

    title = "expired but still held"
    parameter_name = "expired_held"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        eligible = Reservation.objects.eligible()
        if self.value() == "yes":
            return queryset.filter(pk__in=eligible.values("pk"))
        if self.value() == "no":
            return queryset.exclude(pk__in=eligible.values("pk"))
        return None


class PublishedFilter(admin.SimpleListFilter):
    title = "published"
    parameter_name = "published"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.filter(published_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(published_at__isnull=True)
        return None


class OutboxEventInline(admin_guard.ReadOnly, admin.TabularInline):
    model = OutboxEvent
    fields = ("id", "kind", "version", "created_at", "published_at", "payload")
    ordering = ("id",)
    extra = 0
    can_delete = False
    show_change_link = False


@admin.register(Reservation)
class ReservationAdmin(admin_guard.ReadOnly, admin.ModelAdmin):
    list_display = (
        "id",
        "offering",
        "holder",
        "status",
        "version",
        "bucket",
        "expires_at",
        "expired_for",
        "claim_count",
        "released_at",
    )
    list_filter = ("status", "offering", ExpiredButHeldFilter)
    # Searched by get_search_results: an exact id when the term is a number, else the holder.
    search_fields = ("id", "holder")
    search_help_text = "A hold id (exact) or part of a holder."
    list_select_related = ("offering",)
    raw_id_fields = ("offering",)
    show_full_result_count = False
    ordering = ("-id",)
    inlines = (OutboxEventInline,)
    actions = ("release_expired_now",)
    fields = (
        "offering",
        "holder",
        "status",
        "version",
        "expires_at",
        "expired_for",
        "released_version",
        "released_at",
        "release_reason",
        "bucket",
        "next_attempt_at",
        "claim_count",
        "last_claimed_at",
        "last_trace_id",
        "created_at",
        "updated_at",
    )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        sections = reservation_sections()
        return [
            *(s.name for s in sections if s.above),
            *super().get_fields(request, obj),
            *(s.name for s in sections if not s.above),
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return (
            *super().get_readonly_fields(request, obj),
            *(s.name for s in reservation_sections()),
        )

    def __getattr__(self, name: str) -> Callable[[Reservation | None], str]:
        # A section's name resolves like a display method's: Django's admin looks read-only
        # fields up on the ModelAdmin by name (label and value).
        section = _reservation_sections.get(name)
        if section is None:
            raise AttributeError(name)

        def show(obj: Reservation | None) -> str:
            return EMPTY if obj is None or obj.pk is None else section.render(obj)

        return admin.display(description=section.label)(show)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Reservation]:
        # The database clock (PostgreSQL's now(), never the web server's) decides expiry, so
        # the age is computed there.
        expired_for = Case(
            When(
                ELIGIBLE,
                then=ExpressionWrapper(Now() - F("expires_at"), output_field=DurationField()),
            ),
            default=None,
            output_field=DurationField(),
        )
        return super().get_queryset(request).annotate(expired_for_db=expired_for)

    @admin.display(description="expired for", ordering="expired_for_db")
    def expired_for(self, obj: Reservation) -> str:
        delta = getattr(obj, "expired_for_db", None)
        return human_duration(delta) if delta is not None else EMPTY

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Reservation], search_term: str
    ) -> tuple[QuerySet[Reservation], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(holder__icontains=term)
        reservation_id = _as_id(term)
        if reservation_id is not None:
            match |= Q(pk=reservation_id)
        return queryset.filter(match), False

    def has_release_permission(self, request: HttpRequest) -> bool:
        """The action is a state change: it needs the model's change permission."""
        return bool(request.user.has_perm("reservations.change_reservation"))

    @admin.action(description="Release expired holds now", permissions=["release"])
    def release_expired_now(
        self, request: HttpRequest, queryset: QuerySet[Reservation]
    ) -> TemplateResponse | None:
        selection = admin_guard.bounded_selection(
            self, request, queryset, ADMIN_RELEASE_LIMIT, what="holds", done="released"
        )
        if selection is None:
            return None
        ids = selection.ids
        if not admin_guard.confirmed(request):
            eligible = set(
                Reservation.objects.eligible().filter(pk__in=ids).values_list("pk", flat=True)
            )
            return admin_guard.confirmation(
                self,
                request,
                selection,
                action="release_expired_now",
                title="Release expired holds now?",
                verb="release",
                breakdown=[
                    ("expired and still held: will be released", len(eligible)),
                    ("not expired or not held: left as they are", len(ids) - len(eligible)),
                ],
                breakdown_title="state now",
                note="Each hold is released only if it is still held and expired when its "
                "turn comes, exactly as the cleanup does.",
            )
        selected = list(
            Reservation.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "version")
        )
        done: dict[str, list[int]] = {}
        outcomes: Counter[str] = Counter()
        failures: list[str] = []
        for reservation_id, version in selected:
            try:
                outcome = call_with_retries(
                    partial(services.release_if_expired, reservation_id, version, reason="admin")
                )
            except ReservationError as exc:
                outcomes["error"] += 1
                failures.append(f"#{reservation_id}: {exc}")
                continue
            except (DatabaseError, services.TransientConflict) as exc:
                outcomes["error"] += 1
                if is_transient_db_error(exc):
                    failures.append(f"#{reservation_id}: busy (concurrent change), try again")
                else:
                    logger.exception(
                        "admin release failed", extra={"reservation_id": reservation_id}
                    )
                    failures.append(f"#{reservation_id}: database error (logged)")
                continue
            outcomes[outcome.value] += 1
            done.setdefault(outcome.value, []).append(reservation_id)
            logger.info(
                "admin release",
                extra={
                    "reservation_id": reservation_id,
                    "version": version,
                    "outcome": outcome.value,
                    "user_id": request.user.pk,
                },
            )
        # Logged with the holds as they are now (their repr shows the new status).
        holds = Reservation.objects.in_bulk([pk for pks in done.values() for pk in pks])
        admin_guard.log_each(
            request,
            {outcome: [holds[pk] for pk in pks if pk in holds] for outcome, pks in done.items()},
            "release expired holds now",
        )
        released = services.ReleaseOutcome.RELEASED.value
        order = [released] + [o.value for o in services.ReleaseOutcome if o != released] + ["error"]
        summary = ", ".join(f"{name}: {outcomes[name]}" for name in order if outcomes[name])
        self.message_user(
            request,
            summary or "No holds selected.",
            messages.WARNING if failures else messages.SUCCESS,
        )
        if failures:
            self.message_user(request, "Not released: " + "; ".join(failures), messages.ERROR)
        return None


@admin.register(OutboxEvent)
class OutboxEventAdmin(admin_guard.ReadOnly, admin.ModelAdmin):
    list_display = ("id", "kind", "reservation", "version", "created_at", "published_at")
    list_filter = ("kind", PublishedFilter)
    search_fields = ("reservation__id",)
    search_help_text = "A hold id (exact)."
    list_select_related = ("reservation",)
    raw_id_fields = ("reservation",)
    show_full_result_count = False
    ordering = ("-id",)
    readonly_fields = ("kind", "reservation", "version", "payload", "created_at", "published_at")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[OutboxEvent], search_term: str
    ) -> tuple[QuerySet[OutboxEvent], bool]:
        if not search_term.strip():
            return queryset, False
        reservation_id = _as_id(search_term)
        if reservation_id is None:
            return queryset.none(), False
        return queryset.filter(reservation_id=reservation_id), False


# --- API clients and their tokens ---------------------------------------------------------------


class ApiTokenInline(admin.TabularInline):
    """A client's tokens: never editable (a token is issued by the action, revoked by the token
    list's action), never shown in clear (only its first characters are stored)."""

    model = ApiToken
    fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("-id",)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _show_token_once(request: HttpRequest, client: ApiClient, token: str) -> None:
    messages.warning(
        request,
        f"New token for {client.name}: {token} — copy it now; it is stored only as a digest "
        "and will not be shown again.",
    )


@admin.register(ApiClient)
class ApiClientAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "can_read",
        "can_write",
        "all_offerings",
        "requests_per_minute",
        "is_active",
        "valid_tokens",
        "last_used_at",
    )
    list_filter = ("is_active", "can_write")
    search_fields = ("name",)
    filter_horizontal = ("offerings",)
    fields = (
        "name",
        "is_active",
        "can_read",
        "can_write",
        "all_offerings",
        "offerings",
        "requests_per_minute",
        "created_at",
    )
    readonly_fields = ("created_at",)
    inlines = (ApiTokenInline,)
    actions = ("issue_token",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiClient]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                valid_token_count=Count("tokens", filter=Q(tokens__revoked_at__isnull=True)),
                last_used=Max("tokens__last_used_at"),
            )
        )

    @admin.display(description="valid tokens", ordering="valid_token_count")
    def valid_tokens(self, obj: ApiClient) -> int:
        return int(getattr(obj, "valid_token_count", 0))

    @admin.display(description="last used", ordering="last_used")
    def last_used_at(self, obj: ApiClient) -> Any:
        return getattr(obj, "last_used", None) or EMPTY

    def save_model(
        self, request: HttpRequest, obj: ApiClient, form: ModelForm, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        if not change:
            # A new client gets its first token at once, shown this one time.
            _show_token_once(request, obj, clients.issue_token(obj))

    def has_issue_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("reservations.change_apiclient"))

    @admin.action(description="Issue a new token (shown once)", permissions=["issue"])
    def issue_token(self, request: HttpRequest, queryset: QuerySet[ApiClient]) -> None:
        issued = []
        for client in queryset.order_by("pk")[:ADMIN_TOKEN_LIMIT]:
            _show_token_once(request, client, clients.issue_token(client))
            issued.append(client)
        admin_guard.log_each(request, {"issued": issued}, "issue a new API token")

    def has_delete_permission(self, request: HttpRequest, obj: ApiClient | None = None) -> bool:
        # Holds keep their client; a client that must stop is deactivated or its tokens revoked.
        return False


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "client", "created_at", "last_used_at", "revoked_at")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    list_select_related = ("client",)
    search_fields = ("prefix", "client__name")
    fields = ("client", "prefix", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    actions = ("revoke",)
    ordering = ("-id",)

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("reservations.change_apitoken"))

    @admin.action(description="Revoke selected tokens", permissions=["revoke"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> TemplateResponse | None:
        selection = admin_guard.bounded_selection(
            self, request, queryset, ADMIN_TOKEN_LIMIT, what="tokens", done="revoked"
        )
        if selection is None:
            return None
        if not admin_guard.confirmed(request):
            valid = ApiToken.objects.filter(pk__in=selection.ids, revoked_at__isnull=True)
            return admin_guard.confirmation(
                self,
                request,
                selection,
                action="revoke",
                title="Revoke API tokens?",
                verb="revoke",
                breakdown=[
                    ("valid: refused from the next request on", valid.count()),
                    ("already revoked: left as they are", len(selection.ids) - valid.count()),
                ],
                breakdown_title="state now",
                note="A revoked token cannot be restored; issue a new one from its client's page.",
            )
        valid_ids = list(
            ApiToken.objects.filter(pk__in=selection.ids, revoked_at__isnull=True).values_list(
                "pk", flat=True
            )
        )
        revoked = clients.revoke_tokens(ids=valid_ids)
        admin_guard.log_each(
            request,
            {"revoked": list(ApiToken.objects.filter(pk__in=valid_ids))},
            "revoke API token",
        )
        self.message_user(request, f"{revoked} token(s) revoked; they are refused from now on.")
        return None

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # tokens are issued from their client's page, so they can be shown once

    def has_change_permission(self, request: HttpRequest, obj: ApiToken | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiToken | None = None) -> bool:
        return False
