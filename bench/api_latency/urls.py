from django.urls import include, path

from . import variants

urlpatterns = [
    path("hand/", include("reservations.urls")),
    path("ninja/", variants.ninja_api.urls),
    path("drf/holds/<int:hold_id>", variants.DrfHoldDetail.as_view()),
    path("drf/offerings/<int:offering_id>/holds", variants.DrfCreateHold.as_view()),
]
