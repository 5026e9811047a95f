from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    # The cleanup's admin pages (health, pause, runbook) before the admin; /metrics, probes.
    path("", include("cleanup.urls")),
    path("admin/", admin.site.urls),
    # The JSON API, if the project serves it.
    path("api/v1/", include("reservations.urls")),
]
