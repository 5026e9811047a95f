from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    # The cleanup's admin pages first (under admin/), then the admin itself; /metrics and the
    # probes.
    path("", include("cleanup.urls")),
    path("admin/", admin.site.urls),
    # The JSON API, versioned in its path: a change that breaks clients gets a new prefix.
    path("api/v1/", include("reservations.urls")),
]
