from django.contrib import admin
from django.urls import include, path

from cleanup import views as cleanup_views
from cleanup.health_views import health_view

urlpatterns = [
    # Staff only (admin_view redirects anyone else to the admin login).
    path("admin/cleanup/health/", admin.site.admin_view(health_view), name="cleanup-health"),
    path("admin/", admin.site.urls),
    path("api/", include("reservations.urls")),
    path("metrics", cleanup_views.metrics_view, name="metrics"),
    path("healthz", cleanup_views.healthz, name="healthz"),
    path("readyz", cleanup_views.readyz, name="readyz"),
]
