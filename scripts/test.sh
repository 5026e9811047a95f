#!/usr/bin/env bash
# Run every check: ruff, mypy, pytest (unit + real-worker integration). Uses DATABASE_URL /
# CELERY_BROKER_URL when set, else local PostgreSQL/Redis, else private embedded servers.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

declare -a timings=()
phase() {
  local name="$1"; shift
  local start=$SECONDS
  echo "==> $name"
  if "$@"; then
    timings+=("$name: $((SECONDS - start))s ok")
  else
    local rc=$?
    timings+=("$name: $((SECONDS - start))s FAILED (exit $rc)")
    printf '%s\n' "${timings[@]}"
    exit "$rc"
  fi
}

phase "install" ensure_venv requirements-dev.txt
# Prints export lines for the services (starting embedded ones if nothing is reachable).
services_env=$(.venv/bin/python scripts/services.py env --purpose test)
eval "$services_env"
phase "ruff" .venv/bin/ruff check .
phase "mypy" .venv/bin/mypy .
phase "pytest" .venv/bin/python -m pytest "$@"
echo "==> timings"
printf '%s\n' "${timings[@]}"
