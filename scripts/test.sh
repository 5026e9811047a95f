#!/usr/bin/env bash
# Run every check: ruff, mypy, pytest (unit + real-worker integration). Uses DATABASE_URL /
# CELERY_BROKER_URL when set, else local PostgreSQL/Redis (with CI=true, the machine's Debian
# servers are started when installed but stopped), else private embedded servers under .embedded/,
# which are stopped again when this script exits. RESERVATIONS_FORCE_EMBEDDED=1 skips the first two.
# Extra arguments go to pytest (one pytest run of exactly those). Any failure, and pytest's "no
# tests ran" (exit 5), exits non-zero.
#
# With CI=true every tool the suite needs is installed (as root, with apt) when missing, and the
# chaos drills run too; a tool that cannot be had fails the run. In a person's run a missing tool
# skips what needs it, and the end of the output lists everything left out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

in_ci() { case "${CI:-}" in 1|true|TRUE|True|yes) return 0 ;; esac; return 1; }

# Everything this run left out, printed after the timings: pytest appends its skips for missing
# tools to this file (tests/support/missing_tools.py), the phases below their own.
RESERVATIONS_MISSING_TOOLS_FILE=$(mktemp)
export RESERVATIONS_MISSING_TOOLS_FILE
left_out() { echo "$*" >>"$RESERVATIONS_MISSING_TOOLS_FILE"; }
print_left_out() {
  if [ -s "$RESERVATIONS_MISSING_TOOLS_FILE" ]; then
    echo "==> left out of this run (a partial run: install what is missing, or run it in CI)"
    sort -u "$RESERVATIONS_MISSING_TOOLS_FILE"
  fi
}

# apt_install PACKAGE...: install Debian packages (no recommends; apt-get update once on failure).
# Only as root with apt-get; returns non-zero when they could not be installed.
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  echo "installing the Debian package(s) $*"
  apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 \
         && apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; }
}

declare -a timings=()
declare -A lane_pid=() lane_dir=() lane_steps=()
total_start=$SECONDS
# run_phase NAME CMD...: run one phase and note its time; returns its exit status.
run_phase() {
  local name="$1"; shift
  local start=$SECONDS rc=0
  echo "==> $name"
  "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    timings+=("$name: $((SECONDS - start))s ok")
  else
    timings+=("$name: $((SECONDS - start))s FAILED (exit $rc)")
  fi
  return "$rc"
}
# phase NAME CMD...: a phase whose failure ends the run.
phase() { run_phase "$@" || fail_run $?; }
# fail_run RC: let the phases still running beside finish (their output and failures are part
# of the report, and none is left running after this script), then the timings, then exit.
fail_run() {
  local lane
  for lane in "${!lane_pid[@]}"; do finish_lane "$lane" || true; done
  echo "==> timings"
  printf '%s\n' "${timings[@]}"
  print_left_out
  exit "$1"
}

# Stop only the embedded servers that backing_servers.py started for this run (never a shared server,
# never an embedded server that was already running, e.g. for `make run`).
RESERVATIONS_EMBEDDED_STARTED=""
stop_embedded() {
  local rc=$?
  trap - EXIT INT TERM
  rm -f "$RESERVATIONS_MISSING_TOOLS_FILE"
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

# The tools some tests need. With CI=true (as root) a missing one is installed with apt, and one
# that cannot be installed fails the tests that need it (tests/support/missing_tools.py turns their skips
# into failures in CI). Elsewhere nothing is installed: the tests that need it skip, and the end
# of the output lists them.
#   browser tests (tests/integration/browser): Debian's chromium, never a downloaded browser;
#   production-stack drill (test_production_stack.py, marker drill): Debian's servers in
#     network namespaces (prometheus, alertmanager, redis-server, postgresql, docker-compose);
#   chaos drills (test_chaos.py): iptables for the partitions (docs/CHAOS.md);
#   the pooling probe's tests (tests/unit/common/test_pooling.py) and the PgBouncer phase: pgbouncer
#     (installed here, before the unit phase, which needs it first);
#   the kustomize comparisons (tests/unit/project/test_deploy.py): kubectl (Debian's kubernetes-client);
#   the confirmed-publishing unit tests (tests/unit/cleanup/broker/test_confirms.py) and the RabbitMQ
#     phase: rabbitmq-server (started below, before the unit phase, when installed but stopped).
tools_check() {
  local missing=()
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
    || missing+=(chromium)
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v prometheus-alertmanager >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the TLS suites' certificates
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
  command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)  # kustomize renders
  command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] \
    || missing+=(rabbitmq-server)
  [ "${#missing[@]}" = 0 ] && return 0
  if ! in_ci; then
    echo "not installed here: ${missing[*]} (the tests that need them will skip)"
    return 0
  fi
  apt_install "${missing[@]}" \
    || echo "could not install ${missing[*]}: the tests that need them will fail"
  return 0
}
phase "tools" tools_check
# RabbitMQ up before the unit phase (scripts/rabbitmq.py starts it with CI=true when it is
# installed but stopped); without one, a person's run lists the tests that need it at the end.
rabbitmq_up() {
  local rc=0
  .venv/bin/python scripts/rabbitmq.py >/dev/null || rc=$?
  if [ "$rc" = 3 ] && ! in_ci; then return 0; fi
  return "$rc"
}
phase "rabbitmq" rabbitmq_up
# The partition drills run iptables inside a network namespace. Debian's iptables defaults to
# the nf_tables backend (iptables-nft); where the kernel lacks nf_tables the legacy one is used.
iptables_backend() {
  command -v iptables >/dev/null 2>&1 || return 0
  local ns="citest$$" ok=""
  ip netns add "$ns" >/dev/null 2>&1 || return 0
  if ip netns exec "$ns" iptables -A OUTPUT -p tcp --dport 9 -j DROP >/dev/null 2>&1; then
    ok="$(iptables -V 2>/dev/null)"
  elif command -v update-alternatives >/dev/null 2>&1 \
      && update-alternatives --set iptables /usr/sbin/iptables-legacy >/dev/null 2>&1 \
      && ip netns exec "$ns" iptables -A OUTPUT -p tcp --dport 9 -j DROP >/dev/null 2>&1; then
    ok="$(iptables -V 2>/dev/null) (switched to the legacy backend)"
  fi
  ip netns delete "$ns" >/dev/null 2>&1 || true
  if [ -n "$ok" ]; then echo "iptables in a network namespace: $ok"; else
    echo "iptables cannot add a rule in a network namespace here: the partition drills will fail"
  fi
}
in_ci && phase "iptables" iptables_backend

phase "ruff" .venv/bin/ruff check .
phase "ruff-format" .venv/bin/ruff format --check .
phase "mypy" .venv/bin/mypy .
# docker-compose.yml parses with .env.example as its .env (Debian's docker-compose
# validates without a container engine).
compose_config() {
  if ! command -v docker-compose >/dev/null 2>&1; then
    if in_ci; then
      echo "docker-compose is missing in CI (the tools phase could not install it)"
      return 1
    fi
    echo "docker-compose not available: skipping the compose validation"
    left_out "skipped because docker-compose is missing: the compose validation (phase compose)"
    return 0
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
# kombu's and django-celery-beat's own tests against our subclasses (scripts/library_suites.py):
# in lane 2 below, after pytest-b.
library_suites() { .venv/bin/python scripts/library_suites.py; }

# The real-worker correctness suites again on RabbitMQ (duplicates, renewals after the message,
# killed worker and pool child, malformed input and dead letters, backpressure), in a vhost of
# the tests' own (scripts/rabbitmq.py; started with CI=true when installed but stopped; in CI
# installed with apt when missing). Without RabbitMQ a person's run skips them and says so; CI
# fails. They use a test database of their own (the main one's name + _amqp), so they run in lane 3
# beside the Redis integration tests (RabbitMQ's own CPU use is small; all mostly wait on workers).
RABBITMQ_SUITES=(tests/integration/test_delivery.py tests/integration/test_pipeline_scenarios.py
                 tests/integration/test_autoscale.py tests/integration/test_sweep_kill.py)
[ -f tests/integration/test_hostile_input.py ] && RABBITMQ_SUITES+=(tests/integration/test_hostile_input.py)
database_url_with_suffix() {
  .venv/bin/python - "$DATABASE_URL" "$1" <<'PY'
import sys
from urllib.parse import urlsplit, urlunsplit

url, suffix = sys.argv[1], sys.argv[2]
parts = urlsplit(url)
print(urlunsplit(parts._replace(path=parts.path + suffix)))
PY
}
rabbitmq_suites() {
  if in_ci && ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ] \
      && [ -z "${RESERVATIONS_TEST_AMQP_URL:-}" ]; then
    apt_install rabbitmq-server || { echo "CI: rabbitmq-server could not be installed"; return 1; }
  fi
  local exports rc=0
  exports=$(.venv/bin/python scripts/rabbitmq.py) || rc=$?
  if [ "$rc" = 3 ]; then
    if in_ci; then
      echo "CI: no RabbitMQ could be had (reason above): the RabbitMQ suites cannot be skipped in CI"
      return 1
    fi
    echo "RabbitMQ suites SKIPPED (reason above)"
    left_out "skipped because RabbitMQ is missing: the RabbitMQ suites (${RABBITMQ_SUITES[*]})"
    return 0
  elif [ "$rc" != 0 ]; then
    return "$rc"
  fi
  local db
  db=$(database_url_with_suffix _amqp)
  ( eval "$exports" && export DATABASE_URL="$db" \
    && .venv/bin/python -m pytest -p no:cacheprovider "${RABBITMQ_SUITES[@]}" )
}

# The delivery and hostile-input suites again on a TLS Redis (rediss://, how managed Redis
# runs): a private redis-server with a throwaway certificate authority (scripts/tls_redis.py),
# certificate and host-name checks on, a test database of its own (+ _tls). About two minutes;
# in CI and `make test-full`, not in a person's run (which lists it at the end). Without a
# redis-server that has TLS, make test-full skips them and says so; CI fails.
TLS_SUITES=(tests/integration/test_delivery.py tests/integration/test_hostile_input.py)
tls_suites() {
  suites_on_private_server TLS scripts/tls_redis.py _tls "" "TLS redis-server" "${TLS_SUITES[@]}"
}

# The delivery, sweep-kill, beat and burst suites again behind PgBouncer in transaction pooling
# (how large deployments pool connections): a private pgbouncer on a free port
# (scripts/pgbouncer.py) in front of the tests' PostgreSQL; the worker and beat processes reach
# the database through it with DATABASE_POOLING=transaction and the direct URL as DATABASE_DIRECT_URL
# (tests/support/fleet.py), while pytest creates and drops its test database (+ _pgb)
# directly. BROKER_URL ($1): a broker of their own (in lane 3, lane C's Redis database once
# pytest-c is done with it). It runs with the drills (CI and make test-full, about 3½ minutes),
# not in a person's run. Installed with apt in CI when missing; a test-full run without it
# skips them and says so; CI fails when it cannot start.
PGBOUNCER_SUITES=(tests/integration/test_delivery.py tests/integration/test_sweep_kill.py
                  tests/integration/test_beat.py tests/integration/test_burst.py)
pgbouncer_suites() {
  if in_ci && ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
    apt_install pgbouncer || { echo "CI: pgbouncer could not be installed"; return 1; }
  fi
  suites_on_private_server PgBouncer scripts/pgbouncer.py _pgb "$1" pgbouncer \
    "${PGBOUNCER_SUITES[@]}"
}

# suites_on_private_server LABEL SCRIPT DB_SUFFIX BROKER_URL WHAT SUITE...: SCRIPT starts a
# private server in a temporary directory and prints the export lines that reach it (exit 3:
# none could be had, the reason on stderr); pytest runs SUITE... with them, on a test database
# of their own (the main one's name + DB_SUFFIX) and BROKER_URL (empty: the exports' broker, or
# the current one); then SCRIPT stops it. When none could be had a person's run skips the
# suites and lists them at the end (WHAT names the server); CI fails.
suites_on_private_server() {
  local label="$1" script="$2" suffix="$3" broker="$4" what="$5"
  shift 5
  local dir exports rc=0
  dir=$(mktemp -d)
  exports=$(.venv/bin/python "$script" start "$dir") || rc=$?
  if [ "$rc" = 3 ]; then
    rm -rf "$dir"
    if in_ci; then
      echo "CI: no $what could be started (reason above): the $label suites cannot be skipped in CI"
      return 1
    fi
    echo "$label suites SKIPPED (reason above)"
    left_out "skipped because no $what could be started: the $label suites ($*)"
    return 0
  elif [ "$rc" != 0 ]; then
    rm -rf "$dir"
    return "$rc"
  fi
  local db
  db=$(database_url_with_suffix "$suffix")
  ( eval "$exports" && export DATABASE_URL="$db" \
    && if [ -n "$broker" ]; then export CELERY_BROKER_URL="$broker"; fi \
    && .venv/bin/python -m pytest -p no:cacheprovider "$@" ) || rc=$?
  .venv/bin/python "$script" stop "$dir" || true
  rm -rf "$dir"
  return "$rc"
}

# The Sentinel failover drill (tests/integration/test_sentinel_failover.py): Debian's
# redis-server as master, replica and three sentinels (`redis-server --sentinel`), all of the
# drill's own on free ports and in its temporary directory, real workers and beat; the master
# is killed mid-drain. About a minute; with the drills, after them (so it has lane C's broker
# database to itself), on a test database of its own (+ _sentinel). Without
# redis-server a person's run skips it and says so; CI installs it, and fails when it cannot.
SENTINEL_DRILL=tests/integration/test_sentinel_failover.py
sentinel_drill() {
  local rc=0
  drill_server_ready redis-server "Sentinel failover drill" "$SENTINEL_DRILL" \
    "command -v redis-server" redis-server redis-sentinel || rc=$?
  case "$rc" in 0) ;; 1) return 0 ;; *) return 1 ;; esac
  RESERVATIONS_SENTINEL_DRILL=1 pytest_with _sentinel "$1" -s "$SENTINEL_DRILL"
}

# drill_server_ready SERVER LABEL DRILL CHECK PACKAGE...: 0 when CHECK (a command) finds SERVER;
# otherwise CI installs PACKAGE... with apt (2 when it cannot: the drill cannot be skipped in
# CI) and a person's run skips the drill, says so and lists it at the end (1).
drill_server_ready() {
  local server="$1" label="$2" drill="$3" check="$4"
  shift 4
  $check >/dev/null 2>&1 && return 0
  if in_ci; then
    apt_install "$@" && return 0
    echo "CI: $server could not be installed: the $label cannot be skipped in CI"
    return 2
  fi
  echo "$label SKIPPED: $server is not installed"
  left_out "skipped because $server is missing: the $label ($drill)"
  return 1
}

# The RabbitMQ cluster drill (tests/integration/test_rabbitmq_cluster.py): three nodes of
# Debian's rabbitmq-server of the drill's own (node names, ports, data and logs in its temporary
# directory; the machine's RabbitMQ is never touched), joined into a cluster, real workers and
# beat; the release queue's leader is killed mid-drain, with quorum queues and then with classic
# ones. About a minute; with the drills, after the Sentinel drill, on a test database of its
# own (+ _rmqc). Without rabbitmq-server a person's run skips it and says so; CI installs it,
# and fails when it cannot.
RABBITMQ_CLUSTER_DRILL=tests/integration/test_rabbitmq_cluster.py
rabbitmq_cluster_drill() {
  local rc=0
  drill_server_ready rabbitmq-server "RabbitMQ cluster drill" "$RABBITMQ_CLUSTER_DRILL" \
    "test -x /usr/lib/rabbitmq/bin/rabbitmq-server" rabbitmq-server || rc=$?
  case "$rc" in 0) ;; 1) return 0 ;; *) return 1 ;; esac
  RESERVATIONS_RABBITMQ_CLUSTER_DRILL=1 pytest_with _rmqc "$1" -s "$RABBITMQ_CLUSTER_DRILL"
}

# The PostgreSQL failover drill (tests/integration/test_postgres_failover.py): Debian's
# PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) run a primary and a streaming
# standby of the drill's own, on free ports and in private data directories (never the machine's
# server); real workers, two beats and gunicorn share one multi-host DATABASE_URL; the primary
# is stopped hard mid-drain and the standby promoted, with synchronous and then asynchronous
# replication. About a minute; with the drills, after the Sentinel drill (lane C's broker
# database again), on a test database of its own (+ _pgfo). Without the server binaries a
# person's run skips it and says so; CI installs postgresql, and fails when it cannot.
PG_FAILOVER_DRILL=tests/integration/test_postgres_failover.py
pg_failover_drill() {
  local rc=0
  drill_server_ready "PostgreSQL's server binaries" "PostgreSQL failover drill" \
    "$PG_FAILOVER_DRILL" "ls /usr/lib/postgresql/*/bin/initdb" postgresql || rc=$?
  case "$rc" in 0) ;; 1) return 0 ;; *) return 1 ;; esac
  RESERVATIONS_PG_FAILOVER_DRILL=1 pytest_with _pgfo "$1" -s "$PG_FAILOVER_DRILL"
}

# run_lane LANE STEP:FUNCTION...: run the steps one after another in the background, beside the
# phases that follow; each step's output goes to a file of its own (printed whole when the lane
# is finished, so two phases' lines never interleave) and each step runs even if one before it
# failed. finish_lane waits for the lane and reports each step as a phase.
run_lane() {
  local lane="$1"; shift
  local dir spec
  dir=$(mktemp -d)
  lane_dir[$lane]="$dir"; lane_steps[$lane]="$*"
  echo "==> ${*%%:*} (beside the next phases, one after another; output follows when they end)"
  (
    for spec in "$@"; do
      local name="${spec%%:*}" start=$SECONDS rc=0
      "${spec#*:}" >"$dir/$name.log" 2>&1 || rc=$?
      echo "$rc $((SECONDS - start))" >"$dir/$name.status"
    done
  ) &
  lane_pid[$lane]=$!
}
finish_lane() {
  local lane="$1" failed=0 spec name rc took
  [ -n "${lane_pid[$lane]:-}" ] || return 0
  wait "${lane_pid[$lane]}" || true
  unset "lane_pid[$lane]"
  for spec in ${lane_steps[$lane]}; do
    name="${spec%%:*}"
    echo "==> $name (output)"
    cat "${lane_dir[$lane]}/$name.log" 2>/dev/null || true
    read -r rc took <"${lane_dir[$lane]}/$name.status" 2>/dev/null || { rc=1; took=0; }
    if [ "$rc" = 0 ]; then
      timings+=("$name: ${took}s ok (beside other phases)")
    else
      timings+=("$name: ${took}s FAILED (exit $rc; beside other phases)")
      failed="$rc"
    fi
  done
  rm -rf "${lane_dir[$lane]}"
  return "$failed"
}

# pytest_with NAME DB_SUFFIX BROKER_URL ARGS...: pytest on a test database of its own (the main
# one's name + DB_SUFFIX: pytest-django creates test_<name>) and the given broker.
pytest_with() {
  local db_suffix="$1" broker="$2"; shift 2
  local db
  db=$(database_url_with_suffix "$db_suffix")
  DATABASE_URL="$db" CELERY_BROKER_URL="$broker" .venv/bin/python -m pytest -p no:cacheprovider "$@"
}
# Another Redis database for the integration tests run beside the first ones: lane LETTER's
# RESERVATIONS_TEST_BROKER_URL_<LETTER> when given, else the tests' Redis database number +
# OFFSET (B: 13 -> 14, C: 13 -> 15).
lane_redis_url() {
  local letter="$1" offset="$2" given
  given="RESERVATIONS_TEST_BROKER_URL_${letter}"
  if [ -n "${!given:-}" ]; then echo "${!given}"; return; fi
  .venv/bin/python - "$CELERY_BROKER_URL" "$offset" <<'PY'
import sys
from urllib.parse import urlsplit, urlunsplit

parts = urlsplit(sys.argv[1])
number = int(parts.path.strip("/") or 0)
print(urlunsplit(parts._replace(path=f"/{(number + int(sys.argv[2])) % 16}")))
PY
}

# Without pytest arguments the suite runs in three lanes at once, each pytest process with its
# own test database and broker space, because most of the real-worker tests wait on workers
# rather than use the CPU (docs/TESTING.md, "How the suite runs"):
#   lane 1, pytest-unit then pytest-a: the unit tests in a random order (pytest-randomly; the
#      seed is in the phase's name, to replay a failure with `-p randomly --randomly-seed=N`),
#      then the real-worker modules in neither B nor C in file order (the tests' Redis
#      database, the test database);
#   lane 2, pytest-b: the slow waiting real-worker modules (beat, autoscaler, metrics, try-it)
#      on the tests' Redis database + 1 and the test database + _b, then library-suites (the
#      libraries' own tests, CPU-bound, about 30 s; when the lanes' start-up is over), then, in
#      CI (or with RESERVATIONS_DRILLS=1), pytest-tls: the delivery and hostile-input suites on
#      a private TLS Redis (+ _tls);
#   lane 3, pytest-c: the browser tests and the failure-path modules (tests' Redis database + 2,
#      test database + _c), then pytest-rabbitmq: the correctness suites again on RabbitMQ
#      (test database + _amqp), then, in CI (or with RESERVATIONS_DRILLS=1), pytest-pgbouncer:
#      the delivery, sweep-kill, beat and burst suites behind a private PgBouncer in
#      transaction pooling (test database + _pgb).
# Every other pytest here runs in file order (pyproject.toml's addopts keep pytest-randomly off
# unless `-p randomly` is given): the real-worker modules share workers and brokers through
# their fixtures, and a person's `bash scripts/test.sh ARGS` runs exactly as asked.
# Then, in CI (or with RESERVATIONS_DRILLS=1), the drills: the production-stack drill (its own
# servers in network namespaces), the chaos drills, the Sentinel failover drill (its own
# servers; test database + _sentinel) and the RabbitMQ cluster drill (its own three nodes;
# test database + _rmqc). A person's run leaves the drills out and
# says so at the end, with the command that runs them.
GROUP_B=(tests/integration/test_beat.py tests/integration/test_autoscale.py
         tests/integration/test_metrics.py tests/integration/test_try_it.py)
GROUP_C=(tests/integration/browser tests/integration/test_hostile_input.py
         tests/integration/test_failure_paths_real.py tests/integration/test_health_commands.py
         tests/integration/test_task_failures.py)
DRILLS=(tests/integration/test_chaos.py tests/integration/test_production_stack.py)
drills_wanted() { in_ci || [ "${RESERVATIONS_DRILLS:-}" = 1 ]; }
pytest_b() { pytest_with _b "$(lane_redis_url B 1)" "${GROUP_B[@]}"; }
pytest_c() { pytest_with _c "$(lane_redis_url C 2)" "${GROUP_C[@]}"; }
pytest_pgbouncer() { pgbouncer_suites "$(lane_redis_url C 2)"; }
# The drills after the lanes take lane C's Redis database (the lanes are done with it) for the
# test process's own broker (their workers and beat get the drill's own servers where the drill
# is about the broker), or the broker itself when it is not Redis.
drill_broker() {
  case "$CELERY_BROKER_URL" in
    redis://*) lane_redis_url C 2 ;;
    *) echo "$CELERY_BROKER_URL" ;;
  esac
}
pytest_sentinel() { sentinel_drill "$(drill_broker)"; }
pytest_pg_failover() { pg_failover_drill "$(drill_broker)"; }
pytest_rabbitmq_cluster() { rabbitmq_cluster_drill "$(drill_broker)"; }
# The unit tests run in a new random order each run; the seed is in the timings at the end, and
# `bash scripts/test.sh -p randomly --randomly-seed=N tests/unit` replays that order.
unit_seed=$(( (RANDOM << 15 | RANDOM) % 4294967296 ))
if [ "$#" -gt 0 ]; then
  phase "pytest" .venv/bin/python -m pytest "$@"
  left_out "not run because pytest arguments were given: every phase but this pytest run (the" \
    "real-worker lanes, the RabbitMQ, TLS Redis and PgBouncer phases, the library suites, the" \
    "drills). What only they show: acks_late redelivery after a killed worker or pool child," \
    "confirmed publishing end to end on RabbitMQ (a refused batch, a dying quorum leader)," \
    "session locks behind a real PgBouncer, the pause across a real fleet: bash scripts/test.sh"
else
  ignore_lanes=() ignore_drills=()
  for f in "${GROUP_B[@]}" "${GROUP_C[@]}"; do ignore_lanes+=("--ignore=$f"); done
  for f in "${DRILLS[@]}" "$SENTINEL_DRILL" "$RABBITMQ_CLUSTER_DRILL" "$PG_FAILOVER_DRILL"; do
    ignore_drills+=("--ignore=$f")
  done
  case "$CELERY_BROKER_URL" in
    redis://*)
      lane2_steps=("pytest-b:pytest_b" "library-suites:library_suites")
      if drills_wanted; then lane2_steps+=("pytest-tls:tls_suites"); fi
      run_lane "lane-2" "${lane2_steps[@]}"
      lane3_steps=("pytest-c:pytest_c" "pytest-rabbitmq:rabbitmq_suites")
      if drills_wanted; then lane3_steps+=("pytest-pgbouncer:pytest_pgbouncer"); fi
      run_lane "lane-3" "${lane3_steps[@]}"
      # lane 1's second phase runs even when the first failed, as in the other lanes
      unit_rc=0
      run_phase "pytest-unit (seed $unit_seed)" .venv/bin/python -m pytest -p randomly \
        --randomly-seed="$unit_seed" tests/unit || unit_rc=$?
      phase "pytest-a" .venv/bin/python -m pytest tests/integration \
        "${ignore_lanes[@]}" "${ignore_drills[@]}"
      finish_lane "lane-2" || fail_run $?
      finish_lane "lane-3" || fail_run $?
      [ "$unit_rc" = 0 ] || fail_run "$unit_rc"
      ;;
    *)
      echo "the broker is not Redis: the pytest phases one after another (no second broker database)"
      phase "library-suites" library_suites
      unit_rc=0
      run_phase "pytest-unit (seed $unit_seed)" .venv/bin/python -m pytest -p randomly \
        --randomly-seed="$unit_seed" tests/unit || unit_rc=$?
      phase "pytest-a" .venv/bin/python -m pytest tests/integration "${ignore_drills[@]}"
      phase "pytest-rabbitmq" rabbitmq_suites
      if drills_wanted; then
        phase "pytest-tls" tls_suites
        phase "pytest-pgbouncer" pgbouncer_suites "$CELERY_BROKER_URL"
      fi
      [ "$unit_rc" = 0 ] || fail_run "$unit_rc"
      ;;
  esac
  if drills_wanted; then
    phase "pytest-prodstack" pytest_with _stack "$CELERY_BROKER_URL" \
      tests/integration/test_production_stack.py
    phase "pytest-chaos" env RESERVATIONS_CHAOS=1 .venv/bin/python -m pytest -p no:cacheprovider \
      -s tests/integration/test_chaos.py
    phase "pytest-sentinel" pytest_sentinel
    phase "pytest-pg-failover" pytest_pg_failover
    phase "pytest-rabbitmq-cluster" pytest_rabbitmq_cluster
  else
    left_out "not run in a person's run: the production-stack, chaos, Sentinel failover," \
      "PostgreSQL failover and RabbitMQ cluster drills, the TLS Redis phase and the PgBouncer" \
      "phase (tests/integration/test_production_stack.py, test_chaos.py," \
      "test_sentinel_failover.py, test_postgres_failover.py, test_rabbitmq_cluster.py; the" \
      "delivery and hostile-input suites on TLS Redis; the delivery, sweep-kill, beat and" \
      "burst suites behind PgBouncer; CI runs them): make test-full"
  fi
fi

# Alert rules: `promtool test rules` (Debian package prometheus, installed in CI by the tools
# phase). A failing rule test fails the run; a missing promtool fails CI.
promtool_rules() {
  if ! command -v promtool >/dev/null 2>&1; then
    if in_ci; then
      echo "promtool is missing in CI (the tools phase could not install prometheus)"
      return 1
    fi
    echo "promtool not available: skipping the alert rule tests"
    left_out "skipped because promtool is missing: the alert rule tests (phase promtool)"
    return 0
  fi
  promtool check rules deploy/alerts.yml && promtool test rules deploy/alerts_test.yml
}
phase "promtool" promtool_rules
echo "==> timings"
printf '%s\n' "${timings[@]}"
echo "total: $((SECONDS - total_start))s"
print_left_out
