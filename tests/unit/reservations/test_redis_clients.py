"""One Redis client per URL per process (reservations.redis_clients). A pool process forked while a
thread of the worker's main process uses Redis must still be able to use Redis: before the fix,
such a child waited forever on the connection pool's lock, every sweep it ran stopped at its
queue-depth read until the soft time limit, and its shard was never drained. And a client of a
``sentinel://`` URL reaches the master the sentinels name."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from reservations import redis_clients
from tests.support.sentinel import MASTER, PrivateSentinel


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


# --- through a Sentinel -----------------------------------------------------------------------


def test_a_direct_client_of_a_sentinel_url_reaches_the_master_the_sentinels_name(
    private_sentinel: PrivateSentinel, settings: Any
) -> None:
    settings.CELERY_BROKER_SENTINEL_MASTER = MASTER
    client = redis_clients.client(private_sentinel.url)
    client.set("sentinel-unit:probe", b"1")
    assert private_sentinel.master().get("sentinel-unit:probe") == b"1"
    assert client.connection_pool.get_master_address()[1] == private_sentinel.master_port  # type: ignore[attr-defined]
    # one client per URL per process, and none inherited across a fork (as for redis://)
    assert redis_clients.client(private_sentinel.url) is client
    redis_clients._forget_inherited_clients()
    assert redis_clients.client(private_sentinel.url) is not client
