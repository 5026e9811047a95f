#!/usr/bin/env python3
"""Run the libraries' own published tests against our subclasses of their internals.

    .venv/bin/python scripts/library_suites.py                 # both suites
    .venv/bin/python scripts/library_suites.py --include-slow  # with the slow beat test too

- kombu's ``t/unit/transport/test_redis.py`` with ``kombu.transport.redis.Channel`` and
  ``Transport`` replaced by ``cleanup.worker.redis_transport``'s (``suite_plugins.kombu_redis``);
- django-celery-beat's ``t/unit/test_schedulers.py`` with ``DatabaseScheduler`` replaced by
  ``cleanup.release.schedule.LeaderDatabaseScheduler`` (``suite_plugins.celery_beat``).

The sdists are fetched with pip by version and hash (requirements-library-suites.txt), only
their tests are extracted into .cache/library-suites/ (gitignored; the installed libraries are
the ones tested), and the beat suite's test runner (pytest<9, ephem) is installed with its hashes
into .cache/library-suites/tools/ (requirements-library-suites-tools.txt). Each pinned version
must equal requirements.txt's, which is checked first. Needs DATABASE_URL (the beat lock's
PostgreSQL server). Exits non-zero when anything fails. docs/TESTING.md, "The libraries' own
suites".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version as installed_version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-library-suites.txt"
TOOLS_LOCK = ROOT / "requirements-library-suites-tools.txt"
RUNTIME_LOCK = ROOT / "requirements.txt"
CACHE = ROOT / ".cache" / "library-suites"


@dataclass(frozen=True)
class Suite:
    package: str  # as pinned in requirements.txt
    tests: str  # the test module inside the sdist
    plugin: str
    pytest_args: tuple[str, ...] = ()
    own_pytest: bool = False  # run with the tools' pytest (pytest<9) instead of .venv's
    env: dict[str, str] = field(default_factory=dict)


SUITES = (
    Suite(
        "kombu",
        "t/unit/transport/test_redis.py",
        "suite_plugins.kombu_redis",
        # kombu's suite runs without Django set up (pytest-django would set it up at start).
        pytest_args=("-p", "no:django"),
        env={"DJANGO_SETTINGS_MODULE": "config.settings.test"},
    ),
    Suite(
        "django-celery-beat",
        "t/unit/test_schedulers.py",
        "suite_plugins.celery_beat",
        pytest_args=("--ds", "suite_plugins.celery_beat_settings"),
        own_pytest=True,
    ),
)


class PinMismatch(Exception):
    pass


_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str) -> dict[str, tuple[str, set[str]]]:
    """``{canonical name: (version, {sha256, ...})}`` of a hashed requirements file."""
    pins: dict[str, tuple[str, set[str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            current = _canonical(match.group(1))
            pins[current] = (match.group(2), set())
        elif not line.startswith((" ", "\t")):
            current = None
        if current is not None:
            pins[current][1].update(_HASH.findall(line))
    return pins


def check_pins(runtime_text: str, suites_text: str) -> dict[str, tuple[str, set[str]]]:
    """The suites' pins, once each equals requirements.txt's version and its hash is one of
    requirements.txt's hashes for that version; otherwise ``PinMismatch`` naming both."""
    runtime, suites = parse_pins(runtime_text), parse_pins(suites_text)
    problems = []
    for suite in SUITES:
        name = _canonical(suite.package)
        if name not in suites:
            problems.append(f"{suite.package}: not pinned in {LOCK.name}")
            continue
        if name not in runtime:
            problems.append(f"{suite.package}: not pinned in {RUNTIME_LOCK.name}")
            continue
        (want, runtime_hashes), (have, hashes) = runtime[name], suites[name]
        if want != have:
            problems.append(
                f"{suite.package}: {RUNTIME_LOCK.name} pins {want} but {LOCK.name} fetches the "
                f"tests of {have}; pin {suite.package}=={want} there with its sdist's hash and "
                "review the deselected tests in scripts/suite_plugins/"
            )
        elif not hashes or not hashes <= runtime_hashes:
            problems.append(
                f"{suite.package} {have}: the hash in {LOCK.name} is not one of "
                f"{RUNTIME_LOCK.name}'s for that version (copy the sdist's)"
            )
    if problems:
        raise PinMismatch("\n".join(problems))
    return suites


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--quiet", *args], check=True)


def fetch(pins: dict[str, tuple[str, set[str]]]) -> dict[str, Path]:
    """The sdists, downloaded by pip (version and hash checked) unless already in the cache."""
    sdists = CACHE / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)

    def cached(package: str) -> Path | None:
        ver, hashes = pins[_canonical(package)]
        for path in sdists.glob("*.tar.gz"):
            stem = _canonical(path.name.removesuffix(".tar.gz"))
            if stem == _canonical(f"{package}-{ver}") and _sha256(path) in hashes:
                return path
        return None

    if any(cached(s.package) is None for s in SUITES):
        _pip(
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--require-hashes",
            "-r",
            str(LOCK),
            "-d",
            str(sdists),
        )
    found = {}
    for suite in SUITES:
        path = cached(suite.package)
        if path is None:
            raise SystemExit(f"{suite.package}: no sdist with the pinned hash in {sdists}")
        found[suite.package] = path
    return found


def extract_tests(sdist: Path) -> Path:
    """Only the sdist's ``t/`` tree and its pytest configuration (``setup.cfg``), into a fresh
    directory: the library itself is the installed one."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        dest = CACHE / top
        shutil.rmtree(dest, ignore_errors=True)
        members = [
            m
            for m in tar.getmembers()
            if m.name == f"{top}/setup.cfg" or m.name.startswith(f"{top}/t/")
        ]
        tar.extractall(CACHE, members=members, filter="data")
    return dest


def install_lock(lock: Path, target: Path) -> Path:
    """Every package of the hashed ``lock`` installed into ``target`` (put on a PYTHONPATH of
    its own, never into .venv), once per lock file content: a stamp named after the lock's hash
    says it is there, and a changed lock starts ``target`` afresh."""
    stamp = target / f".installed.{_sha256(lock)[:16]}"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        _pip("install", "--no-deps", "--require-hashes", "-r", str(lock), "--target", str(target))
        stamp.touch()
    return target


def install_tools() -> Path:
    """The beat suite's pytest<9 and ephem, with their hashes (TOOLS_LOCK)."""
    return install_lock(TOOLS_LOCK, CACHE / "tools")


def check_installed(pins: dict[str, tuple[str, set[str]]]) -> None:
    for suite in SUITES:
        want = pins[_canonical(suite.package)][0]
        have = installed_version(suite.package)
        if have != want:
            raise PinMismatch(
                f"{suite.package}: {want} is pinned but {have} is installed; install "
                "requirements-dev.txt first"
            )


def start(suite: Suite, tests_dir: Path, tools: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    """One suite's pytest, its output into a log file beside its tests (both suites run at
    once: they mostly wait, on timeouts and sleeps of their own)."""
    path = [str(tools)] if suite.own_pytest else []
    path += [str(ROOT), str(ROOT / "scripts")]
    env = {**os.environ, **suite.env, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("PYTEST_ADDOPTS", None)
    # In the libraries' own order: pytest-randomly, installed for the project's unit tests, would
    # otherwise shuffle them (their configuration, not ours, applies here).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd += ["-p", suite.plugin]
    cmd += [*suite.pytest_args, "-o", "timeout=300", suite.tests, *extra]
    where = tests_dir.relative_to(ROOT)
    print(f"==> {suite.package}: pytest {' '.join(cmd[3:])} (in {where})", flush=True)
    with open(tests_dir / "pytest.log", "wb") as log:
        return subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--include-slow", action="store_true", help="also run the beat suite's slow test"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        pins = check_pins(RUNTIME_LOCK.read_text(), LOCK.read_text())
        check_installed(pins)
    except PinMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not os.environ.get("DATABASE_URL"):
        print("error: DATABASE_URL must be set (the beat lock's PostgreSQL)", file=sys.stderr)
        return 2
    sdists = fetch(pins)
    tools = install_tools()
    print(f"fetched and prepared in {time.monotonic() - started:.1f}s", flush=True)
    running = []
    for suite in SUITES:
        extra = ["--include-slow"] if args.include_slow and suite.own_pytest else []
        tests_dir = extract_tests(sdists[suite.package])
        running.append((suite, tests_dir, start(suite, tests_dir, tools, extra)))
    failed = []
    for suite, tests_dir, process in running:
        rc = process.wait()
        sys.stdout.write((tests_dir / "pytest.log").read_text(errors="replace"))
        outcome = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"==> {suite.package}: {outcome}, {time.monotonic() - started:.1f}s", flush=True)
        if rc != 0:
            failed.append(suite.package)
    print(f"library suites: {time.monotonic() - started:.1f}s in all", flush=True)
    if failed:
        print(f"error: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
