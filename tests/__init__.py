"""The project's tests: tests/unit, tests/integration, and what both share, tests/support."""

import pytest

# The helpers of tests/support assert as tests do: pytest rewrites their asserts too, for the
# same failure messages (registered before any of them is imported).
pytest.register_assert_rewrite("tests.support")
