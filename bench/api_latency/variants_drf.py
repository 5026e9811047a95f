"""The two operations of ``variants`` written with Django REST framework (+ drf-spectacular
for its schema); imported only when djangorestframework is installed."""

from __future__ import annotations

from typing import Any

from rest_framework import authentication, exceptions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from reservations import clients, services
from reservations.api import hold_json
from reservations.clients import Principal

# --- Django REST framework ---------------------------------------------------------------------


class BearerAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Principal] | None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        principal = clients.authenticate(token.strip()) if scheme.lower() == "bearer" else None
        if principal is None:
            raise exceptions.AuthenticationFailed()
        return (None, principal)


class StrictFields(serializers.Serializer):
    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(self.initial_data) - set(self.fields)
        if unknown:
            raise serializers.ValidationError({sorted(unknown)[0]: "unknown field"})
        return attrs


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class HoldSerializer(StrictFields):
    holder = serializers.CharField(max_length=200, trim_whitespace=False)
    ttl_seconds = StrictIntegerField(required=False, allow_null=True)


class DrfHoldDetail(APIView):
    authentication_classes = [BearerAuthentication]
    permission_classes: list[Any] = []

    def get(self, request: Any, hold_id: int) -> Response:
        hold = clients.owned_hold(request.auth, hold_id)
        return Response(hold_json(hold)) if hold else Response({}, status=404)


class DrfCreateHold(APIView):
    authentication_classes = [BearerAuthentication]
    permission_classes: list[Any] = []

    def post(self, request: Any, offering_id: int) -> Response:
        body = HoldSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        hold = services.hold_seat(
            offering_id,
            body.validated_data["holder"],
            body.validated_data.get("ttl_seconds"),
            client_id=request.auth.client_id,
        )
        return Response(hold_json(hold), status=201)
