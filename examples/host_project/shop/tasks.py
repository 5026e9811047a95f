from typing import Any

from celery import shared_task
from django.db import transaction

from shop.models import HandledEvent, Order


@shared_task(name="shop.on_reservation_event")
def on_reservation_event(event: dict[str, Any]) -> None:
    """An order whose hold was released expires; an event seen before is skipped."""
    with transaction.atomic():
        _, first = HandledEvent.objects.get_or_create(
            event_id=event["event_id"], defaults={"kind": event["kind"]}
        )
        if first and event["kind"] == "reservation.released":
            Order.objects.filter(hold_id=event["reservation_id"], status="pending").update(
                status=Order.Status.EXPIRED
            )
