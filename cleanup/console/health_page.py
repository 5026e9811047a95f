"""The admin's "Cleanup health" page (staff only, behind ``admin_site.admin_view``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from cleanup.console import health
from cleanup.console.charts import chart_svg
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
    }
    return TemplateResponse(request, "admin/cleanup/health.html", context)
