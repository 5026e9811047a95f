#!/usr/bin/env bash
# Run every check: ruff, mypy, pytest (unit + real-worker integration). Uses DATABASE_URL /
# CELERY_BROKER_URL when set, else local PostgreSQL/Redis (with CI=true, the machine's Debian
# servers are started when installed but stopped), else private embedded servers under .embedded/,
# which are stopped again when this script exits. RESERVATIONS_FORCE_EMBEDDED=1 skips the first two.
# Extra arguments go to pytest. Any failure, and pytest's "no tests ran" (exit 5), exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

declare -a timings=()
total_start=$SECONDS
phase() {
  local name="$1"; shift
  local start=$SECONDS
  echo "==> $name"
  if "$@"; then
    timings+=("$name: $((SECONDS - start))s ok")
  else
    local rc=$?
    timings+=("$name: $((SECONDS - start))s FAILED (exit $rc)")
    echo "==> timings"
    printf '%s\n' "${timings[@]}"
    exit "$rc"
  fi
}

# Stop only the embedded servers that backing_servers.py started for this run (never a shared server,
# never an embedded server that was already running, e.g. for `make run`).
RESERVATIONS_EMBEDDED_STARTED=""
stop_embedded() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "${RESERVATIONS_EMBEDDED_STARTED:-}" ]; then
    echo "==> stopping embedded servers: $RESERVATIONS_EMBEDDED_STARTED"
    .venv/bin/python scripts/backing_servers.py stop --only "$RESERVATIONS_EMBEDDED_STARTED" || rc=1
  fi
  exit "$rc"
}
trap stop_embedded EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# backing_servers.py prints export lines (starting embedded servers if nothing is reachable); its
# messages go to stderr.
services_up() {
  local exports
  exports=$(.venv/bin/python scripts/backing_servers.py env --purpose test) || return $?
  eval "$exports"
}

phase "install" ensure_venv requirements-dev.txt
phase "services" services_up
# Browser tests (tests/integration/browser) drive Debian's chromium, never a downloaded browser.
# With CI=true as root it is installed with apt when missing; elsewhere a missing chromium makes
# those tests skip with the reason (in CI they fail instead: see their conftest.py).
browser_check() {
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    return 0
  fi
  case "${CI:-}" in 1|true|TRUE|True|yes) ;; *)
    echo "chromium not on PATH: the browser tests will be skipped"; return 0 ;;
  esac
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "chromium missing: installing the Debian package chromium"
    { apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 \
           && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }; } \
      || echo "chromium could not be installed: the browser tests will fail"
  else
    echo "chromium missing and not installable here: the browser tests will fail"
  fi
  return 0
}
phase "browser" browser_check
# The production-stack drill (tests/integration/test_production_stack.py, marker prodstack) runs
# docker-compose.yml's services with Debian's servers in network namespaces. With CI=true as
# root the packages are installed with apt when missing; elsewhere a missing one makes the drill
# skip with the reason (in CI it fails instead).
prodstack_check() {
  local missing=()
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v prometheus-alertmanager >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
  [ "${#missing[@]}" = 0 ] && return 0
  case "${CI:-}" in 1|true|TRUE|True|yes) ;; *)
    echo "missing for the production-stack drill: ${missing[*]} (it will be skipped)"; return 0 ;;
  esac
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing the Debian packages of the production-stack drill: ${missing[*]}"
    { apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 \
           && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }; } \
      || echo "could not install ${missing[*]}: the production-stack drill will fail"
  else
    echo "missing ${missing[*]} and not installable here: the production-stack drill will fail"
  fi
  return 0
}
phase "prodstack-packages" prodstack_check
phase "ruff" .venv/bin/ruff check .
phase "ruff-format" .venv/bin/ruff format --check .
phase "mypy" .venv/bin/mypy .
# docker-compose.yml parses with .env.example as its .env (Debian's docker-compose
# validates without a container engine; installed with apt-get as root in CI when missing).
compose_config() {
  if ! command -v docker-compose >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "docker-compose missing: installing the Debian package docker-compose"
      { apt-get install -y --no-install-recommends docker-compose >/dev/null 2>&1 \
        || { apt-get update >/dev/null 2>&1 \
             && apt-get install -y --no-install-recommends docker-compose >/dev/null 2>&1; }; } \
        || { echo "docker-compose not installable: skipping the compose validation"; return 0; }
    else
      echo "docker-compose not available: skipping the compose validation"
      return 0
    fi
  fi
  # The app services read .env (env_file): validate a copy beside .env.example as that .env, so
  # an operator's own .env in the checkout is neither needed nor read.
  local dir rc=0
  dir=$(mktemp -d)
  cp docker-compose.yml "$dir/" && cp .env.example "$dir/.env"
  (cd "$dir" && docker-compose config -q) && echo "compose: valid" || rc=$?
  rm -rf "$dir"
  return "$rc"
}
phase "compose" compose_config
phase "library-suites" .venv/bin/python scripts/library_suites.py
phase "pytest" .venv/bin/python -m pytest "$@"

# The real-worker correctness suites again on RabbitMQ (duplicates, renewals after the message,
# killed worker and pool child, malformed input and dead letters, backpressure), in a vhost of
# the tests' own (scripts/rabbitmq.py; started with CI=true when installed but stopped). Skipped,
# with the reason, only when no RabbitMQ can be had, or when pytest arguments were given.
RABBITMQ_SUITES=(tests/integration/test_delivery.py tests/integration/test_pipeline_scenarios.py
                 tests/integration/test_autoscale.py tests/integration/test_sweep_kill.py)
[ -f tests/integration/test_hostile_input.py ] && RABBITMQ_SUITES+=(tests/integration/test_hostile_input.py)
rabbitmq_suites() {
  if [ "$#" -gt 0 ]; then
    echo "RabbitMQ suites skipped: pytest arguments were given"
    return 0
  fi
  local exports rc=0
  exports=$(.venv/bin/python scripts/rabbitmq.py) || rc=$?
  if [ "$rc" = 3 ]; then
    echo "RabbitMQ suites SKIPPED (reason above)"
    return 0
  elif [ "$rc" != 0 ]; then
    return "$rc"
  fi
  ( eval "$exports" && .venv/bin/python -m pytest -p no:cacheprovider "${RABBITMQ_SUITES[@]}" )
}
phase "pytest-rabbitmq" rabbitmq_suites "$@"

# Alert rules: `promtool test rules` when promtool is on PATH or installable (Debian package
# `prometheus`, as root with apt-get); skipped with a notice otherwise. A failing rule test fails
# the run.
promtool_rules() {
  if ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "promtool missing: installing the Debian package prometheus"
      { apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
        || { apt-get update >/dev/null 2>&1 \
             && apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; }; } \
        || { echo "promtool not installable: skipping the alert rule tests"; return 0; }
    else
      echo "promtool not available: skipping the alert rule tests"
      return 0
    fi
  fi
  promtool check rules deploy/alerts.yml && promtool test rules deploy/alerts_test.yml
}
phase "promtool" promtool_rules
echo "==> timings"
printf '%s\n' "${timings[@]}"
echo "total: $((SECONDS - total_start))s"
