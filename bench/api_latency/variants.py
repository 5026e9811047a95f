"""Reading a hold and holding a seat, written with django-ninja and with Django REST framework
(+ drf-spectacular for its schema), doing what the hand-written views do: bearer auth through
``reservations.clients``, a strict body (no unknown fields, no coercion), the service call,
the same JSON out."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import NinjaAPI, Schema
from ninja.security import HttpBearer
from pydantic import ConfigDict, Field, StrictInt, StrictStr
from rest_framework import authentication, exceptions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from reservations import clients, services
from reservations.api import hold_json
from reservations.clients import Principal

# --- django-ninja ------------------------------------------------------------------------------


class Bearer(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        return clients.authenticate(token)


class HoldIn(Schema):
    model_config = ConfigDict(extra="forbid")
    holder: StrictStr = Field(min_length=1, max_length=200)
    ttl_seconds: StrictInt | None = None


class HoldOut(Schema):
    id: int
    offering_id: int
    status: str
    version: int
    expires_at: str
    released_version: int | None
    bucket: int
    created_at: str
    released_at: str | None


ninja_api = NinjaAPI(auth=Bearer(), urls_namespace="bench-ninja", docs_url=None)


@ninja_api.get("/holds/{hold_id}", response=HoldOut)
def ninja_hold_detail(request: HttpRequest, hold_id: int) -> Any:
    hold = clients.owned_hold(request.auth, hold_id)  # type: ignore[attr-defined]
    return hold_json(hold) if hold else ninja_api.create_response(request, {}, status=404)


@ninja_api.post("/offerings/{offering_id}/holds", response={201: HoldOut})
def ninja_create_hold(request: HttpRequest, offering_id: int, payload: HoldIn) -> Any:
    principal = request.auth  # type: ignore[attr-defined]
    hold = services.hold_seat(
        offering_id, payload.holder, payload.ttl_seconds, client_id=principal.client_id
    )
    return 201, hold_json(hold)


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
