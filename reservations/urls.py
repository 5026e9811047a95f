"""The reservations JSON API, mounted under ``/api/v1/`` by ``config.urls``."""

from django.urls import URLPattern, path

from . import api, openapi

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
]
