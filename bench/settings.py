"""The settings of every process a benchmark runs: ``config.settings.base`` with the Django
settings the benchmark chose, as JSON in ``BENCH_SETTINGS`` (bench/arms.py). The cleanup's tuning
settings are chosen before base is imported (``config.settings.tuning``), so that what base
derives from them agrees; every setting is then set as given."""

import json
import os

from bench.arms import VARIABLE
from config.settings import tuning

_chosen: dict[str, object] = json.loads(os.environ.get(VARIABLE) or "{}")
tuning.VALUES.update(_chosen)

from config.settings.base import *  # noqa: E402,F403

globals().update(_chosen)
