"""The apps installed from their wheel into another Django project, as a team with its own
project adopts them (docs/INTEGRATION.md): the wheel is built, holds only the product, and
installs into a fresh virtual environment with ``pip check`` clean; ``django-admin
startproject`` makes the host, which adds the apps and its own ``shop`` app
(examples/host_project); it migrates, takes a hold through its own code, and runs the apps'
worker and beat (``celery -A cleanup``) and its own worker, which reads the events. The hold is
released once, with one receipt and one ``reservation.released`` event, and the host's task
expires the order that held it.

Break: drop the templates from the package data; import a model at the top of
``cleanup.worker.events_consumer`` (the host's Celery module imports it while Django loads);
declare ``kombu`` without its ``redis`` extra (its Redis transport imports ``packaging``).
Each fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings

from tests.support import ROOT
from tests.support.fleet import purge_broker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.workers,
    pytest.mark.usefixtures("exclusive_workers"),
    pytest.mark.drill(
        env="RESERVATIONS_HOST_PROJECT",
        reason="the host project runs in a phase of its own: nox -s host-project",
    ),
]

EXAMPLE = ROOT / "examples" / "host_project"
PRODUCT_PACKAGES = {"reservations", "cleanup"}
# What an sdist holds beside the packages: the project's metadata, its README and license.
SDIST_FILES = {
    "PKG-INFO",
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "setup.cfg",
    "reservation_cleanup.egg-info",
}
# The sdist through setuptools' own PEP 517 hook, into the directory given.
SDIST = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
HOLD_TTL_SECONDS = 2
RELEASED_WITHIN_S = 90


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _locked_versions() -> str:
    """requirements.txt's pins without their hashes: the constraints the wheel's own ranges
    are resolved within, so the test installs what CI's lock says, from the wheel's metadata."""
    pins = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        entry = line.split("\\")[0].strip()
        if "==" in entry and not entry.startswith("#"):
            pins.append(entry)
    return "\n".join(pins) + "\n"


def _state(database: dict[str, str], hold: int, order: int) -> dict[str, Any]:
    """What the host's database says of the hold, its receipts and events, and the order: read
    straight from its tables (a `manage.py shell` per poll would cost the lanes a Django start)."""
    conninfo = psycopg.conninfo.make_conninfo(
        dbname=database["SHOP_DATABASE_NAME"],
        host=database["SHOP_DATABASE_HOST"],
        port=database["SHOP_DATABASE_PORT"],
        user=database["SHOP_DATABASE_USER"],
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:

        def column(query: str, *params: object) -> list[Any]:
            return [row[0] for row in conn.execute(query, params).fetchall()]

        released = "SELECT published_at FROM reservations_outboxevent " + (
            "WHERE reservation_id = %s AND kind = 'reservation.released'"
        )
        events = column(released, hold)
        return {
            "status": column("SELECT status FROM reservations_reservation WHERE id = %s", hold)[0],
            "receipts": column(
                "SELECT outcome FROM cleanup_cleanupreceipt WHERE reservation_id = %s", hold
            ),
            "released_events": len(events),
            "published": sum(1 for published_at in events if published_at is not None),
            "order": column("SELECT status FROM shop_order WHERE id = %s", order)[0],
            "handled": column("SELECT kind FROM shop_handledevent ORDER BY kind"),
        }


@pytest.fixture
def host_database() -> Iterator[dict[str, str]]:
    db = settings.DATABASES["default"]
    name = f"{db['NAME']}_host"
    params = {
        "host": str(db.get("HOST") or "127.0.0.1"),
        "port": str(db.get("PORT") or "5432"),
        "user": str(db.get("USER") or "postgres"),
    }

    def admin(statement: str) -> None:
        conninfo = psycopg.conninfo.make_conninfo(dbname="postgres", **params)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(statement)

    admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin(f'CREATE DATABASE "{name}"')
    yield {
        "SHOP_DATABASE_NAME": name,
        "SHOP_DATABASE_HOST": params["host"],
        "SHOP_DATABASE_PORT": params["port"],
        "SHOP_DATABASE_USER": params["user"],
    }
    admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_host_project_installs_the_wheel_and_its_hold_is_released_once(
    tmp_path: Path, host_database: dict[str, str]
) -> None:
    purge_broker()
    # given: the wheel, built from this checkout
    # (from a copy of what the package is made of: an in-place build leaves build/ behind), by
    # way of its sdist, as `python -m build` makes them: the sdist must carry all the wheel needs
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in sorted(PRODUCT_PACKAGES):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, dict(os.environ))
    bin_dir = venv / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "-q", "setuptools>=77"], tmp_path, dict(os.environ))
    sdists = tmp_path / "sdists"
    _run([str(bin_dir / "python"), "-c", SDIST, str(sdists)], source, dict(os.environ))
    (sdist,) = sdists.glob("reservation_cleanup-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
        archive.extractall(tmp_path / "unpacked", filter="data")
    top = {m.split("/")[1] for m in members if m.count("/") >= 1}
    assert top - PRODUCT_PACKAGES <= SDIST_FILES, sorted(top)
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheels = tmp_path / "wheels"
    # (with the setuptools just installed: a second isolated build environment costs CPU the
    # lanes beside this test need)
    _run(
        [*pip, "wheel", str(unpacked), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        tmp_path,
        dict(os.environ),
    )
    (wheel,) = wheels.glob("reservation_cleanup-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == PRODUCT_PACKAGES
    assert "cleanup/templates/admin/cleanup/health.html" in names
    assert "cleanup/operations/console/RUNBOOK.md" in names
    assert "reservations/event_schemas/reservation.released.json" in names
    assert "cleanup/migrations/0001_initial.py" in names

    # and: the fresh virtual environment with it installed, its dependencies from its metadata
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(_locked_versions())
    _run(
        [*pip, "install", "-q", "--no-compile", f"{wheel}[binary]", "-c", str(constraints)],
        tmp_path,
        dict(os.environ),
    )
    _run([*pip, "check"], tmp_path, dict(os.environ))

    # and: a project of its own, with the apps and its shop added as the integration page says
    host = tmp_path / "host"
    host.mkdir()
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "hostsite.settings",
        "SHOP_BROKER_URL": str(settings.CELERY_BROKER_URL),
        "PYTHONUNBUFFERED": "1",
        **host_database,
    }
    _run([str(bin_dir / "django-admin"), "startproject", "hostsite", str(host)], host, env)
    site = host / "hostsite"
    with (site / "settings.py").open("a") as settings_py:
        settings_py.write("\n" + (EXAMPLE / "hostsite" / "settings_tail.py").read_text())
    for name in ("celery.py", "urls.py", "__init__.py"):
        shutil.copy(EXAMPLE / "hostsite" / name, site / name)
    shutil.copytree(EXAMPLE / "shop", host / "shop", ignore=shutil.ignore_patterns("__pycache__"))
    manage = [str(bin_dir / "python"), "manage.py"]
    _run([*manage, "check"], host, env)
    _run([*manage, "migrate", "-v", "0"], host, env)
    _run(
        [
            *manage,
            "install_cleanup_schedule",
            "--shards",
            "1",
            "--every",
            "1",
            "--relay-every",
            "1",
        ],
        host,
        env,
    )

    # when: the host takes a hold through its own code, and runs the apps' worker and beat and
    # its own worker
    order = json.loads(
        _run(
            [
                *manage,
                "shell",
                "--no-imports",
                "-c",
                (
                    "import json; from reservations import services; from shop.services import "
                    "start_checkout; o = services.create_offering('Intro', 3); "
                    f"order = start_checkout(o.id, 'learner-1', {HOLD_TTL_SECONDS}); "
                    "print(json.dumps({'order': order.id, 'hold': order.hold_id}))"
                ),
            ],
            host,
            env,
        )
    )
    celery = str(bin_dir / "celery")
    logs = tmp_path / "logs"
    logs.mkdir()
    commands = {
        "apps-worker": [celery, "-A", "cleanup", "worker", "-c", "2", "-n", "apps@%h"],
        "apps-beat": [celery, "-A", "cleanup", "beat", "-s", str(tmp_path / "beat-schedule")],
        "shop-worker": [celery, "-A", "hostsite", "worker", "-c", "1", "-n", "shop@%h"],
    }
    processes = {
        name: subprocess.Popen(
            [*command, "--loglevel", "INFO"],
            cwd=host,
            env=env,
            stdout=(logs / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for name, command in commands.items()
    }
    try:
        deadline = time.monotonic() + RELEASED_WITHIN_S
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            exited = {n: p.returncode for n, p in processes.items() if p.poll() is not None}
            assert not exited, f"exited early: {exited}\n" + "".join(
                (logs / f"{n}.log").read_text()[-2000:] for n in exited
            )
            state = _state(host_database, order["hold"], order["order"])
            if state["order"] == "expired":
                break
            time.sleep(0.5)
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        purge_broker()

    # then: released once, with one receipt and one event, and the host's order expired by its
    # own task, which saw each of the hold's events once
    assert state == {
        "status": "released",
        "receipts": ["released"],
        "released_events": 1,
        "published": 1,
        "order": "expired",
        "handled": ["reservation.held", "reservation.released"],
    }, "".join(f"\n--- {n}\n" + (logs / f"{n}.log").read_text()[-3000:] for n in commands)
