"""The benchmarks' own database: created when missing and migrated, before Django is set up
(the benchmarks choose their settings first)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.paths import ROOT


def ensure_migrated_database(url: str) -> None:
    """Create the database ``url`` names on its server when it is missing, then migrate it."""
    import psycopg

    server, _, name = url.rpartition("/")
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=dict(os.environ),
        check=True,
    )
