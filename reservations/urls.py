"""The reservations JSON API, mounted under ``/api/`` by ``config.urls``."""

from django.urls import URLPattern, path

from . import api

app_name = "reservations"

urlpatterns: list[URLPattern] = [
    path("offerings/<int:offering_id>/holds", api.create_hold, name="create-hold"),
    path(
        "offerings/<int:offering_id>/availability",
        api.offering_availability,
        name="availability",
    ),
    path("holds/<int:hold_id>", api.hold_detail, name="hold-detail"),
    path("holds/<int:hold_id>/renew", api.renew_hold, name="renew-hold"),
    path("holds/<int:hold_id>/confirm", api.confirm_hold, name="confirm-hold"),
    path("holds/<int:hold_id>/cancel", api.cancel_hold, name="cancel-hold"),
]
