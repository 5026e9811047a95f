"""cleanup.processes: the liveness check the metrics reaper and the embedded servers' scripts
use to tell a dead process's leftovers from a live one's."""

from __future__ import annotations

import os
import subprocess
import sys

from cleanup.processes import pid_alive


def test_a_running_process_is_alive_and_one_that_exited_is_not() -> None:
    # given: a child that is running, then the same child after it exited and was reaped
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    # then: its pid no longer names a process (reaped: not even a zombie)
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())
