"""Drill tooling: the burst drill, its report, real worker processes and the invariant checks
from SQL. Used by management commands, the benchmarks and the tests; no runtime module of the
product imports this package (tests/unit/test_structure.py checks it)."""
