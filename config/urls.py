from django.contrib import admin
from django.urls import include, path

from cleanup.console import endpoints
from cleanup.console.health_page import health_view

urlpatterns = [
    # Staff only (admin_view redirects anyone else to the admin login).
    path("admin/cleanup/health/", admin.site.admin_view(health_view), name="cleanup-health"),
    path("admin/", admin.site.urls),
    # The JSON API, versioned in its path: a change that breaks clients gets a new prefix.
    path("api/v1/", include("reservations.urls")),
    path("metrics", endpoints.metrics_view, name="metrics"),
    path("healthz", endpoints.healthz, name="healthz"),
    path("readyz", endpoints.readyz, name="readyz"),
]
