"""The burst drill, its report, real worker processes and the invariant checks from SQL. Used
by ``manage.py burst``, the benchmarks and the tests; no product module imports ``tools``
(tests/unit/project/test_structure.py checks it)."""
