"""The release core: schedule -> sweep (claim) -> publish -> release, with the delivery policy
and its cap, admission and sizing, the outbox, dead letters and the locks they share. Imports
the foundation (conf, models, sql, metrics) and the broker's readers, never the worker's edge or
operations (tests/unit/project/test_structure.py checks it)."""
