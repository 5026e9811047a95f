from django.db import models


class Order(models.Model):
    """A customer's checkout: one seat held while they pay. The hold is the apps' row; the
    order refers to it and learns of its release from the events."""

    class Status(models.TextChoices):
        PENDING = "pending"
        PAID = "paid"
        EXPIRED = "expired"

    customer = models.CharField(max_length=200)
    hold = models.OneToOneField(
        "reservations.Reservation", on_delete=models.PROTECT, related_name="order"
    )
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)

    def __str__(self) -> str:
        return f"order {self.pk} of {self.customer} ({self.status})"


class HandledEvent(models.Model):
    """Events are delivered at least once: each is handled once, by its id."""

    event_id = models.BigIntegerField(primary_key=True)
    kind = models.CharField(max_length=40)

    def __str__(self) -> str:
        return f"{self.kind} #{self.event_id}"
