from django.db import transaction

from reservations import services
from shop.models import Order


def start_checkout(offering_id: int, customer: str, ttl_seconds: int) -> Order:
    """Hold a seat for the customer and open their order, in one transaction."""
    with transaction.atomic():
        hold = services.hold_seat(offering_id, customer, ttl_seconds)
        return Order.objects.create(customer=customer, hold=hold)
