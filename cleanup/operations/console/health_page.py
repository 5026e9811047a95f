"""The admin's "Cleanup health" page (staff only, behind ``admin_site.admin_view``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from cleanup.operations.console import health
from cleanup.operations.console.charts import chart_svg
from cleanup.release import pause
from reservations import admin_guard
from reservations.admin import _as_id
from reservations.models import Reservation


def health_view(request: HttpRequest) -> HttpResponse:
    hold = request.GET.get("hold", "").strip()
    if hold:
        pk = _as_id(hold)
        if pk is not None and Reservation.objects.filter(pk=pk).exists():
            return HttpResponseRedirect(reverse("admin:reservations_reservation_change", args=[pk]))
        messages.warning(request, f"No hold with id {hold!r}.")
    snapshot = health.collect(with_workers=request.GET.get("workers") != "0")
    context: dict[str, Any] = {
        **admin.site.each_context(request),
        "title": "Cleanup health",
        "subtitle": None,
        "h": snapshot,
        "charts": chart_svg(snapshot.samples),
        "dead_letter_url": reverse("admin:cleanup_deadletter_changelist"),
        "schedule_url": reverse("admin:cleanup_cleanupschedule_changelist"),
        "eligible_url": reverse("admin:reservations_reservation_changelist") + "?expired_held=yes",
        "pause": pause.state(),
        "can_pause": request.user.has_perm("cleanup.change_releasepause"),
    }
    return TemplateResponse(request, "admin/cleanup/health.html", context)


PAUSE_PERMISSION = "cleanup.change_releasepause"


def pause_view(request: HttpRequest) -> HttpResponse:
    """POST from the health page: pause or resume releases, audited (who, when, why), then back
    to the health page. Pausing needs a reason: the next person on call reads it there."""
    if request.method != "POST":
        return HttpResponseRedirect(reverse("cleanup-health"))
    if not request.user.has_perm(PAUSE_PERMISSION):
        raise PermissionDenied
    wanted = request.POST.get("action")
    reason = request.POST.get("reason", "").strip()
    if wanted not in ("pause", "resume"):
        messages.error(request, "Unknown action: nothing changed.")
        return HttpResponseRedirect(reverse("cleanup-health"))
    if wanted == "pause" and not reason:
        messages.error(request, "Say why releases are paused: the reason is shown to everyone.")
        return HttpResponseRedirect(reverse("cleanup-health"))
    who = request.user.get_username()
    row = pause.set_paused(wanted == "pause", who, reason)
    if row is None:
        messages.info(
            request, f"Releases were already {'paused' if wanted == 'pause' else 'running'}."
        )
        return HttpResponseRedirect(reverse("cleanup-health"))
    result = f"paused ({reason})" if row.paused else "resumed" + (f" ({reason})" if reason else "")
    admin_guard.log_each(request, {result: [row]}, "releases")
    if row.paused:
        messages.warning(
            request,
            "Releases paused: workers stop consuming the release queue within a few seconds; "
            "sweeps and the gauges go on.",
        )
    else:
        messages.success(request, "Releases resumed: workers consume the release queue again.")
    return HttpResponseRedirect(reverse("cleanup-health"))
