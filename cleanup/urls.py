"""The cleanup's pages, for a project's root URLconf (``path("", include("cleanup.urls"))``,
before ``admin.site.urls``): the admin's health page, pause switch and runbook (staff only,
through the project's admin site), and the Prometheus scrape and the probes."""

from django.contrib import admin
from django.urls import path

from cleanup.operations.console import endpoints
from cleanup.operations.console.health_page import health_view, pause_view
from cleanup.operations.console.runbook import runbook_view

urlpatterns = [
    # Staff only (admin_view redirects anyone else to the admin login).
    path("admin/cleanup/health/", admin.site.admin_view(health_view), name="cleanup-health"),
    path("admin/cleanup/health/pause/", admin.site.admin_view(pause_view), name="cleanup-pause"),
    # What each alert's runbook_url links to (RUNBOOK.md beside the renderer).
    path("admin/cleanup/runbook/", admin.site.admin_view(runbook_view), name="cleanup-runbook"),
    path("metrics", endpoints.metrics_view, name="metrics"),
    path("healthz", endpoints.healthz, name="healthz"),
    path("readyz", endpoints.readyz, name="readyz"),
]
