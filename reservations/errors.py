"""Domain errors. The API maps them to HTTP statuses; the admin shows their message."""

from __future__ import annotations


class ReservationError(Exception):
    """Base of every domain error; ``code`` is stable for API clients."""

    code = "reservation_error"


class OfferingNotFound(ReservationError):
    code = "offering_not_found"


class ReservationNotFound(ReservationError):
    code = "reservation_not_found"


class NoSeatsAvailable(ReservationError):
    code = "no_seats_available"


class StaleVersion(ReservationError):
    """The caller's expected version is not the hold's current one (it changed meanwhile)."""

    code = "stale_version"

    def __init__(self, reservation_id: int, expected: int, actual: int) -> None:
        super().__init__(
            f"hold {reservation_id} is at version {actual}, not the expected {expected}"
        )
        self.expected = expected
        self.actual = actual


class NotHeld(ReservationError):
    """The hold is confirmed, cancelled or released, so it can no longer change."""

    code = "not_held"

    def __init__(self, reservation_id: int, status: str) -> None:
        super().__init__(f"hold {reservation_id} is {status}, not held")
        self.status = status


class ReservationExpired(ReservationError):
    """Renew or confirm of a hold whose expires_at has passed (even if cleanup has not run)."""

    code = "hold_expired"

    def __init__(self, reservation_id: int) -> None:
        super().__init__(f"hold {reservation_id} has expired; create a new hold")


class InvalidTtl(ReservationError):
    code = "invalid_ttl"
