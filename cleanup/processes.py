"""Whether a process is alive, for code that reaps what dead processes left behind (the workers'
metric files, the embedded servers' pid files)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when ``pid`` names a running process, including one of another user (signal 0 is
    refused with ``PermissionError`` then, which still proves it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
