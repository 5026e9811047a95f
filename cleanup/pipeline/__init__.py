"""The release pipeline: schedule -> sweep (claim) -> publish -> release, with the outbox, the
dead letters and the locks they share. Imports telemetry and the broker readers, never above."""
