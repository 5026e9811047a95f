#!/usr/bin/env bash
# Run every check: make .venv (scripts/venv.sh), then the suite's nox sessions (noxfile.py,
# `.venv/bin/nox -l` lists them): `nox -s all`, which runs ruff, mypy and the compose check, then
# pytest in three lanes at once, then (CI=true or RESERVATIONS_DRILLS=1) the drills. Extra
# arguments go to pytest: after the checks, one pytest run of exactly those. Any failure, and
# pytest's "no tests ran" (exit 5), exits non-zero. docs/TESTING.md, "How the suite runs".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
ensure_venv requirements-dev.txt
exec .venv/bin/nox --noxfile noxfile.py --sessions all -- "$@"
