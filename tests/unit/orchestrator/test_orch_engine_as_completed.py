"""`orchestrator.engine_pool.vllm_http.as_completed`: a request cancelled by the client's close() ends the wait at once.

The stdlib's as_completed/wait never hear of a future cancelled in the executor's queue, and sleep
until their timeout: a rollout on an engine whose client the pool closed (the engine died) stalled
for the whole timeout.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from orchestrator.engine_pool.vllm_http import as_completed


def test_a_future_cancelled_by_shutdown_ends_the_wait():
    executor = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    running = executor.submit(release.wait, 5)
    queued = executor.submit(time.sleep, 0)
    executor.shutdown(wait=False, cancel_futures=True)  # what HttpVllmEngine.close() does
    assert queued.cancelled()
    started, seen = time.monotonic(), []
    with pytest.raises(RuntimeError, match="1 requests were cancelled"):
        waiting = as_completed([running, queued], timeout_s=30)
        release.set()
        seen.extend(waiting)
    assert seen == [running] and time.monotonic() - started < 5


def test_times_out_like_the_stdlib():
    executor = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    slow = executor.submit(release.wait, 5)
    with pytest.raises(concurrent.futures.TimeoutError):
        list(as_completed([slow], timeout_s=0.2))
    release.set()
    executor.shutdown(wait=True)
