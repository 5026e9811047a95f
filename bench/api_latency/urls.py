from django.conf import settings
from django.urls import URLPattern, URLResolver, include, path

from . import variants

urlpatterns: list[URLPattern | URLResolver] = [
    path("served/", include("reservations.urls")),
    path("ninja/", variants.ninja_api.urls),
]
if getattr(settings, "HAS_DRF", False):
    from . import variants_drf

    urlpatterns += [
        path("drf/holds/<int:hold_id>", variants_drf.DrfHoldDetail.as_view()),
        path("drf/offerings/<int:offering_id>/holds", variants_drf.DrfCreateHold.as_view()),
    ]
