# Sourced by the run and test scripts: create .venv with a supported Python and install the
# locked requirements when they changed (every package pinned with its hashes, compiled from the
# requirements*.in files by scripts/lock.sh; pip refuses anything unpinned or with another hash). Python 3.11 or 3.12 (the embedded servers ship
# wheels for those).
ensure_venv() {
  local reqs="$1"
  if [ ! -x .venv/bin/python ]; then
    local py=""
    for candidate in "${PYTHON:-}" python3.12 python3.11 python3; do
      [ -n "$candidate" ] || continue
      if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 12) else 1)' 2>/dev/null; then
        py="$candidate"; break
      fi
    done
    if [ -z "$py" ]; then
      echo "error: need Python 3.11 or 3.12 on PATH (or set PYTHON=/path/to/python)" >&2
      return 1
    fi
    echo "creating .venv with $("$py" -V 2>&1) ($py)"
    # Debian and Ubuntu ship Python without venv/ensurepip until a package adds them.
    if ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
      local minor
      minor=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      echo "error: $py has no venv/ensurepip module. On Debian or Ubuntu install it with:" >&2
      echo "  sudo apt-get install python${minor}-venv" >&2
      return 1
    fi
    if ! "$py" -m venv .venv; then
      rm -rf .venv
      echo "error: '$py -m venv .venv' failed (see above)" >&2
      return 1
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
  fi
  # One stamp per requirements file (requirements.txt for `make run`, requirements-dev.txt for
  # `make test`), keyed on the content of every requirements file, so neither hides the other.
  local hash
  hash=$(cat requirements*.txt | sha256sum | cut -c1-16)
  local stamp=".venv/.installed.${reqs}.${hash}"
  if [ ! -f "$stamp" ]; then
    echo "installing $reqs into .venv"
    .venv/bin/python -m pip install --quiet --require-hashes -r "$reqs"
    # Packages the project once pinned and dropped, removed from a .venv that still has them so
    # it behaves like a fresh one (types-redis's stubs would hide redis-py's own annotations).
    .venv/bin/python -m pip uninstall --quiet --yes types-redis >/dev/null 2>&1 || true
    rm -f ".venv/.installed.${reqs}."*
    touch "$stamp"
  fi
}
