"""Admin for dead letters (list, filter, requeue, discard) and receipts (read-only), and the
hold's records and story on the reservation page.

The hold's page gets its sections through ``reservations.admin.add_reservation_section``, the domain
admin's hook for other apps: ``reservations`` never imports ``cleanup``, and neither admin
module depends on being imported first (tests/unit/reservations/test_admin.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Count, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.text import capfirst
from django_celery_beat.admin import PeriodicTaskAdmin, PeriodicTaskForm
from django_celery_beat.models import PeriodicTask

from cleanup.models import CleanupReceipt, CleanupSchedule, DeadLetter, ReleasePause
from cleanup.operations import schedule_preview, triage
from cleanup.operations.console.story import explain
from cleanup.release import dead_letters, delivery_cap, periodic_guard
from cleanup.release.messages import idempotency_key
from cleanup.release.schedule import MANAGED_NOTE, SWEEP_PREFIX, apply_schedule, is_managed
from reservations import admin_guard
from reservations.admin import EMPTY, ReservationSection, add_reservation_section
from reservations.models import OutboxEvent, Reservation

# Dead letters one requeue may send (the confirmation page says so when more match).
REQUEUE_LIMIT = 1000
# Dead letters one discard may resolve: a discard sends nothing (one UPDATE per thousand), so
# its bound is the default open-letter cap, and a full cap of one reason goes in one click.
DISCARD_LIMIT = 10_000
# Task names the "task" filter offers (the most frequent among open letters); any other is
# reachable as ?task_name=<name>.
TASK_FILTER_CHOICES = 15
NO_TASK = "-"  # the task filter's value for letters without a task name


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


class TaskFilter(admin.SimpleListFilter):
    """The open letters' most frequent task names (an unknown_task letter's name is whatever
    its sender wrote, so the list is bounded)."""

    title = "task"
    parameter_name = "task_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        top = (
            DeadLetter.objects.filter(resolved_at__isnull=True)
            .values("task_name")
            .annotate(n=Count("id"))
            .order_by("-n", "task_name")[:TASK_FILTER_CHOICES]
        )
        return [(row["task_name"] or NO_TASK, row["task_name"] or "(none)") for row in top]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value is None:
            return None
        return queryset.filter(task_name="" if value == NO_TASK else value)


class OlderThanFilter(admin.SimpleListFilter):
    """Letters written more than this long ago (``?older_than=30m``, ``6h``, ``7d``, …)."""

    title = "written more than … ago"
    parameter_name = "older_than"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("1h", "1 hour"), ("1d", "1 day"), ("7d", "7 days"), ("30d", "30 days")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value is None:
            return None
        try:
            age = triage.parse_age(value)
        except ValueError as exc:
            messages.error(request, f"older_than: {exc}; that filter was not applied.")
            return None
        return queryset.filter(created_at__lt=timezone.now() - age)


class ReadOnlyAdmin(admin_guard.ReadOnly, admin.ModelAdmin):
    """Receipts and dead letters are records: inspected, never edited."""


def _hold_link(reservation_id: int | None) -> str:
    if not reservation_id:
        return EMPTY
    url = reverse("admin:reservations_reservation_change", args=[reservation_id])
    return format_html('<a href="{}">hold #{}</a>', url, reservation_id)


def _changelist_link(model: str, query: dict[str, Any], text: str) -> str:
    url = reverse(f"admin:{model}_changelist") + "?" + urlencode(query)
    return format_html('<a href="{}">{}</a>', url, text)


class ByReservationLookupMixin:
    """Allows ``?reservation_id=<id>`` in the list URL (the links from a hold's page)."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if lookup in ("reservation_id", "idempotency_key"):
            return True
        return bool(super().lookup_allowed(lookup, value, request))  # type: ignore[misc]


class ReservationRecordAdmin(ByReservationLookupMixin, ReadOnlyAdmin):
    """Dead letters and receipts: records of one hold's message, found by hold, trace, task or
    message key, newest first, each linking to its hold."""

    search_fields = ("=reservation_id", "=trace_id", "=task_id", "idempotency_key")
    ordering = ("-id",)
    show_full_result_count = False

    @admin.display(description="hold", ordering="reservation_id")
    def hold(self, obj: DeadLetter | CleanupReceipt) -> str:
        return _hold_link(obj.reservation_id)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReservationRecordAdmin):
    list_display = (
        "id",
        "reason",
        "hold",
        "version",
        "task_name",
        "delivery_count",
        "trace_id",
        "created_at",
        "resolved_at",
        "resolution",
        "resolved_by",
    )
    list_filter = ("reason", OpenFilter, TaskFilter, OlderThanFilter)
    actions = ("requeue", "discard")
    fields = (
        "reason",
        "hold",
        "version",
        "receipt",
        "delivery_count",
        "idempotency_key",
        "task_name",
        "task_id",
        "trace_id",
        "error",
        "payload",
        "message",
        "created_at",
        "resolved_at",
        "resolution",
        "resolved_by",
        "resolution_note",
        "summarised_count",
        "summarised_first_at",
        "summarised_last_at",
    )

    @admin.display(description="receipt")
    def receipt(self, obj: DeadLetter) -> str:
        if not obj.idempotency_key:
            return EMPTY
        found = CleanupReceipt.objects.filter(idempotency_key=obj.idempotency_key).first()
        if found is None:
            return f"none for {obj.idempotency_key}"
        url = reverse("admin:cleanup_cleanupreceipt_change", args=[found.pk])
        return format_html('<a href="{}">receipt #{} ({})</a>', url, found.pk, found.outcome)

    @admin.action(description="Requeue selected dead letters", permissions=["requeue"])
    def requeue(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> TemplateResponse | None:
        selection = admin_guard.bounded_selection(
            self, request, queryset, REQUEUE_LIMIT, what="dead letters", done="requeued"
        )
        if selection is None:
            return None
        letters = list(DeadLetter.objects.filter(pk__in=selection.ids).order_by("pk"))
        if not admin_guard.confirmed(request):
            by_reason = Counter(str(letter.reason) for letter in letters)
            planned = triage.requeue(letters, dry_run=True)
            return admin_guard.confirmation(
                self,
                request,
                selection,
                action="requeue",
                title="Requeue dead letters?",
                verb="requeue",
                breakdown=[
                    *((f"reason: {r}", n) for r, n in sorted(by_reason.items())),
                    *((f"will be: {a}", n) for a, n in sorted(planned.items())),
                ],
                breakdown_title="what will be sent",
                note="A republished message keeps its idempotency key: one that was in fact "
                "handled ends already_handled. A set-aside hold becomes due for a sweep again.",
            )
        done: dict[str, list[Any]] = {}
        results = triage.requeue(
            letters,
            on_each=lambda letter, what: done.setdefault(what, []).append(letter),
            by=request.user.get_username(),
        )
        admin_guard.log_each(request, done, "requeue")
        summary = ", ".join(f"{what}: {n}" for what, n in sorted(results.items())) or "nothing"
        if results["error"]:
            self.message_user(
                request,
                f"Requeue: {summary}. A send failed, so the requeue stopped there: that letter "
                f"and the {results[triage.NOT_TRIED]} after it stay open. Requeue them again "
                f"once the broker and the database answer (the log names the error).",
                messages.ERROR,
            )
            return None
        failed = any(k.startswith(("not_", "already")) for k in results)
        self.message_user(
            request, f"Requeue: {summary}", messages.WARNING if failed else messages.SUCCESS
        )
        return None

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("cleanup.change_deadletter"))

    @admin.action(
        description="Discard selected dead letters (resolve, send nothing)", permissions=["discard"]
    )
    def discard(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> TemplateResponse | None:
        """Resolve the selected letters as ``discarded``, with the operator's name and why;
        nothing is sent. A confirmation page first says how many, by reason, and asks why."""
        selection = admin_guard.bounded_selection(
            self, request, queryset, DISCARD_LIMIT, what="dead letters", done="discarded"
        )
        if selection is None:
            return None
        letters = list(DeadLetter.objects.filter(pk__in=selection.ids).order_by("pk"))
        if not letters:
            self.message_user(
                request,
                "None of the selected dead letters is left to discard (they no longer match "
                "the list's filter); nothing was discarded.",
                messages.WARNING,
            )
            return None
        why = request.POST.get("why", "")
        error = ""
        if admin_guard.confirmed(request):
            try:
                why = triage.clean_why(why)
            except ValueError as exc:
                error = capfirst(str(exc)) or ""
        if not admin_guard.confirmed(request) or error:
            open_letters = [letter for letter in letters if letter.resolved_at is None]
            resolved = len(letters) - len(open_letters)
            return admin_guard.confirmation(
                self,
                request,
                selection,
                action="discard",
                title="Discard dead letters?",
                verb="discard",
                breakdown=[
                    *((f"reason: {r}", n) for r, n in triage.by_reason(open_letters)),
                    *([("already resolved: left as they are", resolved)] if resolved else []),
                ],
                breakdown_title="open letters that will be discarded",
                note="Discarding resolves each open letter (resolution: discarded) with your "
                "name and the reason below; nothing is sent or rescheduled, and its "
                "history says so. Resolved letters are deleted after "
                "CLEANUP_DEAD_LETTER_RETENTION_DAYS days.",
                inputs=[
                    admin_guard.ConfirmInput(
                        name="why",
                        label="Why are they discarded?",
                        value=why,
                        error=error,
                        help="Kept on each letter and in its history, for whoever looks next.",
                        maxlength=dead_letters.WHY_LIMIT,
                    )
                ],
            )
        done = triage.discard(letters, by=request.user.get_username(), why=why)
        discarded = done.get(dead_letters.DISCARDED, [])
        admin_guard.log_each(request, {f"discarded; why: {why}": discarded}, "discard")
        skipped = len(done.get("already_resolved", []))
        summary = f"Discard: discarded: {len(discarded)}"
        if skipped:
            summary += f", already resolved (left as they are): {skipped}"
        self.message_user(request, summary, messages.WARNING if skipped else messages.SUCCESS)
        return None

    def has_discard_permission(self, request: HttpRequest) -> bool:
        """A state change: the model's change permission, as for requeue (the letters
        themselves stay read-only in the admin)."""
        return bool(request.user.has_perm("cleanup.change_deadletter"))


@admin.register(CleanupReceipt)
class CleanupReceiptAdmin(ReservationRecordAdmin):
    list_display = (
        "id",
        "idempotency_key",
        "hold",
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
    fields = (
        "idempotency_key",
        "hold",
        "version",
        "outcome",
        "attempt",
        "deliveries_counted",
        "dead_letters",
        "worker",
        "task_id",
        "trace_id",
        "queue_age_seconds",
        "duration_ms",
        "created_at",
    )

    @admin.display(description="redeliveries counted")
    def deliveries_counted(self, obj: CleanupReceipt) -> str:
        return _deliveries(obj.idempotency_key)

    @admin.display(description="dead letters")
    def dead_letters(self, obj: CleanupReceipt) -> str:
        n = DeadLetter.objects.filter(idempotency_key=obj.idempotency_key).count()
        if not n:
            return "none"
        return _changelist_link(
            "cleanup_deadletter", {"idempotency_key": obj.idempotency_key}, f"{n} dead letter(s)"
        )


def _deliveries(key: str) -> str:
    """The redelivery counter of a message key (kept for CLEANUP_DELIVERY_COUNTER_TTL). A first
    delivery is not counted (cleanup.release.delivery_cap), so 0 means none came back."""
    try:
        n = delivery_cap.current(key)
    except Exception:  # noqa: BLE001 - the counter is informative here
        return "unavailable"
    if not n:
        return f"0 redeliveries, or the counter expired (counter for {key})"
    return f"{n} redeliveries, {n + 1} deliveries (counter for {key})"


# --- On a hold's page: its records, its delivery count, its story ----------------------------


def _linked_records(hold: Reservation) -> str:
    pk = int(hold.pk)
    receipts = CleanupReceipt.objects.filter(reservation_id=pk).count()
    letters = DeadLetter.objects.filter(reservation_id=pk).count()
    open_letters = DeadLetter.objects.filter(reservation_id=pk, resolved_at__isnull=True).count()
    events = OutboxEvent.objects.filter(reservation_id=pk).count()
    return format_html(
        '<span id="hold-links">{} · {} · {} · <a href="#story">story (explain_hold)</a></span>',
        _changelist_link(
            "cleanup_cleanupreceipt", {"reservation_id": pk}, f"{receipts} receipt(s)"
        ),
        _changelist_link(
            "cleanup_deadletter",
            {"reservation_id": pk},
            f"{letters} dead letter(s), {open_letters} open",
        ),
        _changelist_link("reservations_outboxevent", {"q": pk}, f"{events} outbox event(s)"),
    )


def _hold_deliveries(hold: Reservation) -> str:
    return _deliveries(idempotency_key(int(hold.pk), int(hold.version)))


def _hold_story(hold: Reservation) -> str:
    return format_html(
        '<pre id="story" style="white-space: pre-wrap">{}</pre>', explain(int(hold.pk)).text()
    )


# Added to the domain's ReservationAdmin (its documented hook), not a second registration: the
# hold's page is the same whatever the order of INSTALLED_APPS.
add_reservation_section(
    ReservationSection("related", "linked records", _linked_records, above=True)
)
add_reservation_section(
    ReservationSection("deliveries_counted", "redeliveries (current version)", _hold_deliveries)
)
add_reservation_section(ReservationSection("story", "story (explain_hold)", _hold_story))


# --- The release pause ------------------------------------------------------------------------


@admin.register(ReleasePause)
class ReleasePauseAdmin(ReadOnlyAdmin):
    """Read-only: the switch is on the health page (audited there); this shows its state and
    its History, one entry per pause and resume."""

    fields = ("paused", "since", "changed_by", "reason")
    list_display = ("__str__", "reason")


# --- The Cleanup schedule ---------------------------------------------------------------------


@admin.register(CleanupSchedule)
class CleanupScheduleAdmin(admin.ModelAdmin):
    """One object. Saving it rewrites the per-shard sweep entries in the same transaction."""

    fields = ("shards", "every_seconds", "enabled", "updated_at", "entries")
    readonly_fields = ("updated_at", "entries")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not CleanupSchedule.objects.exists() and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        schedule = CleanupSchedule.objects.order_by("pk").first()
        if schedule is not None:
            return HttpResponseRedirect(
                reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk])
            )
        return super().changelist_view(request, extra_context)

    def save_model(
        self, request: HttpRequest, obj: CleanupSchedule, form: ModelForm, change: bool
    ) -> None:
        with transaction.atomic():
            obj.save()
            result = apply_schedule(obj)
        self.message_user(
            request,
            f"Sweep entries: {result['changed']} created or changed, {result['removed']} "
            f"removed. Beat follows within its loop interval; no restart needed.",
            messages.SUCCESS,
        )

    def get_urls(self) -> list[Any]:
        preview = path(
            "<path:object_id>/change/preview/",
            self.admin_site.admin_view(self.preview_view),
            name="cleanup_cleanupschedule_preview",
        )
        # before the admin's own: its catch-all "<object_id>/" would take the URL otherwise
        return [preview, *super().get_urls()]

    def preview_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The change form's values (POSTed by its "Preview the change" button), applied inside
        a transaction that is rolled back: the entries the save would add, remove and change,
        and the sweeps per second before and after. Nothing is written; the page's own button
        saves the same values through the change form."""
        obj = self.get_object(request, object_id)
        if obj is None or not self.has_change_permission(request, obj):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseRedirect(
                reverse("admin:cleanup_cleanupschedule_change", args=[obj.pk])
            )
        form = self.get_form(request, obj, change=True)(request.POST, instance=obj)
        planned = None
        if form.is_valid():
            edited = form.save(commit=False)

            def change() -> None:
                edited.save()
                apply_schedule(edited)

            planned = schedule_preview.preview(change)
            obj.refresh_from_db()
        context = {
            **self.admin_site.each_context(request),
            "title": "Preview of the schedule change",
            "subtitle": None,
            "opts": self.opts,
            "original": obj,
            "form": form,
            "planned": planned,
            "values": {name: request.POST.get(name, "") for name in ("shards", "every_seconds")},
            "enabled": bool(request.POST.get("enabled")),
            "change_url": reverse("admin:cleanup_cleanupschedule_change", args=[obj.pk]),
        }
        return TemplateResponse(request, "admin/cleanup/schedule_preview.html", context)

    @admin.display(description="beat entries it manages")
    def entries(self, obj: CleanupSchedule) -> str:
        rows = PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).order_by("name")
        if not rows:
            return "none yet (saved on the next save)"
        return format_html(
            '<ul id="managed-entries">{}</ul>',
            format_html_join(
                "",
                '<li><a href="{}">{}</a> — every {}s, {}, last sent {}</li>',
                (
                    (
                        reverse("admin:django_celery_beat_periodictask_change", args=[e.pk]),
                        e.name,
                        e.interval.every if e.interval else "?",
                        "enabled" if e.enabled else "disabled",
                        e.last_run_at or "never",
                    )
                    for e in rows
                ),
            ),
        )


class CleanupPeriodicTaskForm(PeriodicTaskForm):  # type: ignore[misc]
    """django-celery-beat's form, refusing a task that is not one of this project's periodic
    tasks (Celery's built-ins included), an interval below the floor and routing away from the
    project's queues (cleanup.release.periodic_guard), each message on the field to change."""

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean()
        refused = periodic_guard.problems(
            data.get("task"),
            data.get("interval"),
            data.get("queue"),
            data.get("exchange"),
            data.get("routing_key"),
        )
        for field, message in refused.items():
            self.add_error(field, message)
        return data


class CleanupAwarePeriodicTaskAdmin(PeriodicTaskAdmin):  # type: ignore[misc]
    """django-celery-beat's admin, with the entries the Cleanup schedule manages read-only and
    every entry kept to the project's periodic tasks, a sane interval and the project's
    queues."""

    form = CleanupPeriodicTaskForm
    list_display = (*PeriodicTaskAdmin.list_display, "managed_by")

    @admin.display(description="managed by")
    def managed_by(self, obj: PeriodicTask) -> str:
        if not is_managed(obj.name):
            return ""
        return format_html(
            '<a href="{}">Cleanup schedule</a>', reverse("admin:cleanup_cleanupschedule_changelist")
        )

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and is_managed(obj.name):
            return False
        return bool(super().has_change_permission(request, obj))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and is_managed(obj.name):
            return False
        return bool(super().has_delete_permission(request, obj))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: Any = None,
    ) -> HttpResponse:
        entry = PeriodicTask.objects.filter(pk=object_id).only("name").first()
        if entry is not None and is_managed(entry.name) and request.method == "GET":
            url = reverse("admin:cleanup_cleanupschedule_changelist")
            self.message_user(
                request,
                format_html('{} <a href="{}">Open it</a>.', MANAGED_NOTE, url),
                messages.INFO,
            )
        return cast(HttpResponse, super().change_view(request, object_id, form_url, extra_context))

    def _unmanaged(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> Any:
        managed = queryset.filter(name__startswith=SWEEP_PREFIX)
        if managed.exists():
            self.message_user(
                request,
                f"{managed.count()} entr(y/ies) left unchanged: {MANAGED_NOTE}",
                messages.WARNING,
            )
        return queryset.exclude(name__startswith=SWEEP_PREFIX)

    # django-celery-beat's actions, each offered only to users who may change periodic tasks
    # (a viewer does not see them, and a hand-made POST naming one is refused like any action
    # the user lacks) and each leaving one history entry per task acted on. The bulk ones still
    # call django-celery-beat's own, which update the rows and then PeriodicTasks.update_changed()
    # so that beat re-reads the schedule.

    def _bulk_change(
        self,
        request: HttpRequest,
        queryset: QuerySet[PeriodicTask],
        change: Callable[[HttpRequest, QuerySet[PeriodicTask]], Any],
        what: str,
    ) -> None:
        ids = list(self._unmanaged(request, queryset).values_list("pk", flat=True))
        with transaction.atomic():
            # The UPDATE locks the rows until commit, so the rows read back below are what it
            # wrote (a concurrent toggle waits), and their history says the state they are in.
            change(request, PeriodicTask.objects.filter(pk__in=ids))
            tasks = list(PeriodicTask.objects.filter(pk__in=ids).order_by("pk"))
            by_state: dict[str, list[Any]] = {}
            for task in tasks:
                by_state.setdefault("enabled" if task.enabled else "disabled", []).append(task)
            admin_guard.log_each(request, by_state, what)

    @admin.action(description="Enable selected tasks", permissions=["change"])
    def enable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._bulk_change(request, queryset, super().enable_tasks, "enable selected tasks")

    @admin.action(description="Disable selected tasks", permissions=["change"])
    def disable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._bulk_change(request, queryset, super().disable_tasks, "disable selected tasks")

    @admin.action(description="Toggle activity of selected tasks", permissions=["change"])
    def toggle_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._bulk_change(request, queryset, super().toggle_tasks, "toggle selected tasks")

    @admin.action(description="Run selected tasks", permissions=["change"])
    def run_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        """Sends each selected task now (managed sweep entries too: one extra sweep of a shard
        is harmless). django-celery-beat's action sends nothing when any selected task is not
        registered, so only a selection that is all registered is logged, as ``sent``."""
        tasks = list(PeriodicTask.objects.filter(pk__in=queryset.values("pk")).order_by("pk"))
        # A row the form would refuse (written past it) is not sent from here either, as beat
        # does not send it (cleanup.release.periodic_guard).
        refused = {task.name: periodic_guard.row_problems(task) for task in tasks}
        refused = {name: problems for name, problems in refused.items() if problems}
        for name, problems in refused.items():
            self.message_user(
                request, f"{name} not sent: {' '.join(problems.values())}", messages.ERROR
            )
        tasks = [task for task in tasks if task.name not in refused]
        if not tasks:
            return
        self.celery_app.loader.import_default_modules()
        sendable = all(self.celery_app.tasks.get(task.task) is not None for task in tasks)
        super().run_tasks(
            request, PeriodicTask.objects.filter(pk__in=[t.pk for t in tasks]).order_by("pk")
        )
        if sendable:
            admin_guard.log_each(request, {"sent": tasks}, "run selected tasks")


if admin.site.is_registered(PeriodicTask):
    admin.site.unregister(PeriodicTask)
admin.site.register(PeriodicTask, CleanupAwarePeriodicTaskAdmin)

# The index links to the health page (templates/admin/cleanup_index.html).
admin.site.index_template = "admin/cleanup_index.html"
