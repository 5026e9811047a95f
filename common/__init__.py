"""Project plumbing both apps use: the PostgreSQL connection (``db``), the admin's guarded
actions (``admin_guard``) and the management commands' base class (``commands``).

It imports neither ``reservations`` nor ``cleanup``: the domain and the cleanup machinery sit on
top of it, never the other way round (tests/unit/project/test_structure.py)."""
