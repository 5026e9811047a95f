"""Reading a hold and holding a seat written minimally with django-ninja (and, in
``variants_drf``, with Django REST framework + drf-spectacular, when installed): bearer auth
through ``reservations.clients``, a strict body (no unknown fields, no coercion), the service
call, the same JSON out. A fixed reference beside the served API."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import NinjaAPI, Schema
from ninja.security import HttpBearer
from pydantic import ConfigDict, Field, StrictInt, StrictStr

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
    holder: str
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
