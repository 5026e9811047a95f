"""A pool process forked while a thread of the worker's main process uses Redis must still be
able to use Redis (cleanup.redis_clients). Before the fix, such a child waited forever on the
connection pool's lock: every sweep it ran stopped at its queue-depth read until the soft time
limit, and its shard was never drained."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def test_a_child_forked_while_a_thread_holds_the_redis_pool_lock_still_reads_the_queue(
    settings: Any,
) -> None:
    from cleanup.broker import readers as broker

    assert settings.BROKER_IS_REDIS, "this test reads a Redis queue"
    # given: the parent has used the shared client, and another thread holds its pool's lock
    # (as the autoscaler's reader does, briefly, on every reading)
    broker.queue_depth("fork-test")
    pool: Any = broker.redis_client().connection_pool
    held, release = threading.Event(), threading.Event()

    def hold_the_pool_lock() -> None:
        with pool._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_pool_lock)
    holder.start()
    held.wait(5)

    # when: the process forks at that instant and the child reads the queue depth
    pid = os.fork()
    if pid == 0:  # the child: a stuck read is ended by SIGALRM's default action
        signal.alarm(5)
        try:
            broker.queue_depth("fork-test")
        except BaseException:  # noqa: BLE001 - any error is a failure, reported by exit code
            os._exit(1)
        os._exit(0)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)

    # then: the child read the depth and exited normally
    assert os.WIFEXITED(status), f"the child was killed by signal {os.WTERMSIG(status)} (stuck)"
    assert os.WEXITSTATUS(status) == 0, "the child's read raised"
