from django.contrib import admin
from django.urls import include, path

from cleanup import views as cleanup_views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("reservations.urls")),
    path("metrics", cleanup_views.metrics_view, name="metrics"),
    path("healthz", cleanup_views.healthz, name="healthz"),
    path("readyz", cleanup_views.readyz, name="readyz"),
]
