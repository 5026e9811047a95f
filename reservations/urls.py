"""The reservations JSON API, mounted under ``/api/v1/`` by ``config.urls``."""

from django.urls import URLPattern, path, re_path

from . import api, openapi, problems

app_name = "reservations"

urlpatterns: list[URLPattern] = [
    # GET lists the offering's holds; POST holds a seat.
    path("offerings/<int:offering_id>/holds", api.offering_holds, name="offering-holds"),
    path(
        "offerings/<int:offering_id>/availability",
        api.offering_availability,
        name="availability",
    ),
    path("holds", api.holds, name="holds"),
    path("holds/<int:hold_id>", api.hold_detail, name="hold-detail"),
    path("holds/<int:hold_id>/renew", api.renew_hold, name="renew-hold"),
    path("holds/<int:hold_id>/confirm", api.confirm_hold, name="confirm-hold"),
    path("holds/<int:hold_id>/cancel", api.cancel_hold, name="cancel-hold"),
    # The OpenAPI document (public) and Swagger UI over it (staff); the names are the ones
    # django-ninja's docs page reverses.
    path("openapi.json", openapi.openapi_json, name="openapi-json"),
    path("docs", openapi.docs, name="openapi-view"),
    # What each error answer's ``type`` names (reservations.problems).
    path("problems/<slug:code>", problems.describe, name="problem-type"),
    # Last: any other path is a JSON 404 problem, whatever the method.
    re_path(r"^(?P<rest>.*)$", api.no_such_path, name="no-such-path"),
]
