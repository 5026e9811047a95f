"""Values of the cleanup's tuning settings (``cleanup.conf.tuning``: Django settings that are
never read from the environment), by name, that a settings module built on
``config.settings.base`` chooses before importing it, so that what base derives from them (the
queues and routes, the Redis transport options) and the checks between fields see them too:
``config.settings.test`` shortens two, and a test's or a benchmark's child processes get theirs
this way (``tests/support/child_settings.py``, ``bench/settings.py``). Empty in a deployment: every
tuning setting keeps its default."""

VALUES: dict[str, object] = {}
