"""Local settings (config.settings.local) start on a fresh clone with nothing set."""

from __future__ import annotations

from tests.support.child_python import DEPLOYED, run_as_deployed


def test_local_settings_start_on_a_fresh_clone_with_nothing_set() -> None:
    # given: none of the variables production refuses to default (what `make run` starts with)
    unset: dict[str, str | None] = {k: None for k in DEPLOYED}
    out = run_as_deployed(
        "from django.conf import settings; import os;"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings.local';"
        "print(settings.DEBUG, settings.DATABASES['default']['NAME'], bool(settings.SECRET_KEY))",
        **unset,
    )
    # then: development defaults, a local database, debug on
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "reservations", "True"]
