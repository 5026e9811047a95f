#!/usr/bin/env python3
"""Write a ``.env`` for docker-compose from ``.env.example`` with every ``change-me`` value
replaced by a fresh random secret (URL-safe, long enough for the production settings' checks).

    python3 scripts/make_env.py            # writes .env beside docker-compose.yml; refuses to
                                           # overwrite an existing one
    python3 scripts/make_env.py --stdout   # prints it instead

Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def render(example: str) -> str:
    lines = []
    for line in example.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#") and "change-me" in value:
            user, colon, _password = value.partition(":")
            secret = secrets.token_urlsafe(48)
            value = f"{user}:{secret}" if colon else secret
            line = f"{key}={value}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdout", action="store_true")
    args = parser.parse_args()
    text = render((ROOT / ".env.example").read_text())
    if args.stdout:
        sys.stdout.write(text)
        return 0
    target = ROOT / ".env"
    if target.exists():
        print(f"{target} exists; not overwriting it (remove it first)", file=sys.stderr)
        return 1
    target.write_text(text)
    target.chmod(0o600)
    print(f"wrote {target} (mode 600) with fresh secrets", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
