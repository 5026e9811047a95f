"""The reservations JSON API, mounted under ``/api/v1/`` by ``config.urls``: the operations
django-ninja serves (``reservations.api``), the document, problem types, and a JSON 404 for
every other path."""

from django.urls import URLPattern, URLResolver, path, re_path

from . import api, openapi, problems

app_name = "reservations"

# ninja's own root page is not served: a path no operation has is a problem (below).
_NINJA_EXTRAS = {"api-root"}

urlpatterns: list[URLPattern | URLResolver] = [
    *(p for p in api.api.urls[0] if getattr(p, "name", None) not in _NINJA_EXTRAS),
    # The OpenAPI document (public) and Swagger UI over it (staff); the names are the ones
    # django-ninja's docs page reverses.
    path("openapi.json", openapi.openapi_json, name="openapi-json"),
    path("docs", openapi.docs, name="openapi-view"),
    # What each error answer's ``type`` names (reservations.problems).
    path("problems/<slug:code>", problems.describe, name="problem-type"),
    # Last: any other path is a JSON 404 problem, whatever the method.
    re_path(r"^(?P<rest>.*)$", api.no_such_path, name="no-such-path"),
]
