"""Warm pool of pre-started, single-use sandboxes, and the allocator of their host uids.

    refill thread ──spawn()──▶ [ready sandboxes] ──acquire()──▶ one run, then discarded

A sandbox is never reused: the pool only moves the start-up (bwrap namespaces + interpreter
start) off the request's critical path. Each live sandbox holds its own host uid, so the
per-uid process limit (RLIMIT_NPROC) of one run cannot starve another.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class UidAllocator:
    """Hands out host uids from [base, base + count); each is held by one live sandbox."""

    def __init__(self, base: int, count: int) -> None:
        if base < 1000 or count <= 0:
            raise ValueError(f"uid range must have base >= 1000 and count > 0, got {base}, {count}")
        self._free = collections.deque(range(base, base + count))
        self._held: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {len(self._held)} sandbox uids are in use; raise num_uids")
            uid = self._free.popleft()
            self._held.add(uid)
            return uid

    def release(self, uid: int) -> None:
        with self._lock:
            assert uid in self._held, f"uid {uid} released twice"
            self._held.remove(uid)
            self._free.append(uid)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)


class WarmPool(Generic[T]):
    """Keeps `size` spawned items ready; `acquire` takes one (or spawns one when empty)."""

    def __init__(
        self,
        spawn: Callable[[], T],
        size: int,
        *,
        is_alive: Callable[[T], bool],
        discard: Callable[[T], None],
        retry_delay_s: float = 1.0,
    ) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self._spawn = spawn
        self._size = size
        self._is_alive = is_alive
        self._discard = discard
        self._retry_delay_s = retry_delay_s
        self._ready: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_spawned = 0
        self.num_cold = 0
        self.num_errors = 0
        self.last_error = ""

    def start(self) -> None:
        if self._size > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._refill, name="sandbox-pool", daemon=True)
            self._thread.start()

    def acquire(self) -> T:
        with self._cond:
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            while self._ready:
                item = self._ready.popleft()
                self._cond.notify_all()
                if self._is_alive(item):
                    return item
                self._discard(item)
        self.num_cold += 1
        return self._spawn_counted()

    def stats(self) -> dict:
        with self._cond:
            return {
                "size": self._size,
                "ready": len(self._ready),
                "spawned": self.num_spawned,
                "cold_starts": self.num_cold,
                "errors": self.num_errors,
                "last_error": self.last_error,
            }

    def close(self, timeout_s: float = 10.0) -> None:
        # Discard the ready items while the refill thread that spawned them still lives: a
        # child's parent-death signal (bwrap --die-with-parent) follows the spawning *thread*.
        with self._cond:
            self._closed = True
            items, self._ready = list(self._ready), collections.deque()
        for item in items:
            self._discard(item)
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("sandbox pool refill thread did not stop within %.1f s", timeout_s)

    def _spawn_counted(self) -> T:
        item = self._spawn()
        with self._cond:
            self.num_spawned += 1
        return item

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self._size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                item = self._spawn_counted()
            except Exception as exc:  # noqa: BLE001 - keep the pool alive; the error shows in /health
                with self._cond:
                    self.num_errors += 1
                    self.last_error = str(exc)
                    logger.error("sandbox pool could not start a sandbox: %s", exc)
                    self._cond.wait(self._retry_delay_s)
                continue
            with self._cond:
                if self._closed:
                    discard_now = True
                else:
                    discard_now = False
                    self._ready.append(item)
            if discard_now:
                self._discard(item)
                return
