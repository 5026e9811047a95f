#!/usr/bin/env bash
# `make run`: create/update .venv, then hand over to the Python supervisor (scripts/run.py), which
# finds or starts PostgreSQL and Redis, migrates, and runs web + worker + beat + Flower in the
# foreground until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
ensure_venv requirements.txt
exec .venv/bin/python scripts/run.py "$@"
