"""The connection's own statements (common.db): session settings, no table of either app."""

# The statement timeout of the current transaction only (``SET LOCAL``), in milliseconds.
LOCAL_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"
# Prepared statements of this connection planned once, generically (common/db.py).
FORCE_GENERIC_PLANS = "SET plan_cache_mode = force_generic_plan"
# Which server process answers this client (common.pooling's probe compares two answers).
BACKEND_PID = "SELECT pg_backend_pid()"
