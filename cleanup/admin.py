"""Admin for dead letters (list, filter, requeue) and receipts (read-only), and the hold's
story on the reservation page.

The story is added by extending the registered ``ReservationAdmin`` here, so ``reservations``
never imports ``cleanup`` (``reservations`` is listed first in INSTALLED_APPS, so its admin
module is already loaded when this one runs).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from reservations.admin import ReservationAdmin
from reservations.models import Reservation

from . import deadletters
from .models import CleanupReceipt, DeadLetter
from .story import explain


class OpenFilter(admin.SimpleListFilter):
    title = "resolved"
    parameter_name = "resolved"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", "Open"), ("yes", "Resolved")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "no":
            return queryset.filter(resolved_at__isnull=True)
        if self.value() == "yes":
            return queryset.filter(resolved_at__isnull=False)
        return None


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "reason",
        "reservation_id",
        "version",
        "task_name",
        "delivery_count",
        "trace_id",
        "created_at",
        "resolved_at",
        "resolution",
    )
    list_filter = ("reason", OpenFilter)
    search_fields = ("=reservation_id", "=trace_id", "=task_id", "idempotency_key")
    ordering = ("-id",)
    show_full_result_count = False
    actions = ("requeue",)

    @admin.action(description="Requeue selected dead letters", permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        results = deadletters.requeue(queryset.order_by("id"))
        summary = ", ".join(f"{what}: {n}" for what, n in sorted(results.items())) or "nothing"
        level = messages.WARNING if any("not_" in k for k in results) else messages.SUCCESS
        self.message_user(request, f"Requeue: {summary}", level)

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("cleanup.change_deadletter"))


@admin.register(CleanupReceipt)
class CleanupReceiptAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "idempotency_key",
        "outcome",
        "attempt",
        "worker",
        "task_id",
        "trace_id",
        "queue_age_seconds",
        "duration_ms",
        "created_at",
    )
    list_filter = ("outcome",)
    search_fields = ("=reservation_id", "=trace_id", "=task_id", "idempotency_key")
    ordering = ("-id",)
    show_full_result_count = False


class ReservationStoryAdmin(ReservationAdmin):
    """The registered ReservationAdmin plus a read-only "story" (what explain_hold prints)."""

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        return [*super().get_fields(request, obj), "story"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [*super().get_readonly_fields(request, obj), "story"]

    @admin.display(description="story (explain_hold)")
    def story(self, obj: Reservation) -> str:
        if obj is None or obj.pk is None:
            return "—"
        return format_html(
            '<pre style="white-space: pre-wrap">{}</pre>', explain(int(obj.pk)).text()
        )


if admin.site.is_registered(Reservation):
    admin.site.unregister(Reservation)
admin.site.register(Reservation, ReservationStoryAdmin)
