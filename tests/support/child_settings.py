"""The settings of a child process a test starts with Django settings of its own (a worker,
beat, a command; ``tests.support.child_python.settings_env``): ``config.settings.test`` plus the
settings given as JSON in ``RESERVATIONS_TEST_SETTINGS``. The cleanup's tuning settings
(``cleanup.conf.tuning``) are chosen before the test settings are imported
(``config.settings.tuning``), so that the queues, routes and transport options derived from them
agree; every setting is then set as given. A cleanup setting read from the environment is
refused here: a test gives it as a variable, the way a deployment does."""

import dataclasses
import json
import os

from cleanup.conf import ENV, ENVIRONMENT, CleanupSettings
from config.settings import tuning
from tests.support.child_python import CHILD_SETTINGS_VARIABLE

_chosen: dict[str, object] = json.loads(os.environ.get(CHILD_SETTINGS_VARIABLE) or "{}")
_variables = sorted(
    spec.metadata[ENV]
    for spec in dataclasses.fields(CleanupSettings)
    if spec.metadata[ENVIRONMENT] and spec.metadata[ENV] in _chosen
)
if _variables:
    raise RuntimeError(
        f"{CHILD_SETTINGS_VARIABLE} names {', '.join(_variables)}: an environment variable, "
        "give it in the child's environment"
    )
tuning.VALUES.update(_chosen)

from config.settings.test import *  # noqa: E402,F403

globals().update(_chosen)
