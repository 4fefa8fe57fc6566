"""A stand-in for a vLLM process killed with SIGKILL: it maps a named shared-memory segment it never
removes, writes the segment's name to the file in argv[1], then waits. Run with `python -c LEAKY_ENGINE`.

`wait_for_segment` finds the segment once its name is written; `remove_segment` cleans up after a test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

LEAKY_ENGINE = (
    "import sys, time\n"
    "from multiprocessing import resource_tracker, shared_memory\n"
    "seg = shared_memory.SharedMemory(create=True, size=4096)\n"
    "resource_tracker.unregister(seg._name, 'shared_memory')\n"
    "open(sys.argv[1], 'w').write(seg.name)\n"
    "time.sleep(120)\n"
)


def wait_for_segment(name_file: Path, alive: Callable[[], bool], timeout_s: float = 30.0) -> Path:
    """The segment whose name the stand-in writes to `name_file`, once written (while `alive()`)."""
    deadline = time.monotonic() + timeout_s
    while not name_file.exists() or not name_file.read_text():
        assert alive(), "the stand-in ended before it wrote its segment's name"
        assert time.monotonic() < deadline, f"no segment name in {name_file} within {timeout_s:.0f} s"
        time.sleep(0.05)  # polling for the segment's name, bounded by the deadline
    return Path("/dev/shm") / name_file.read_text()


def remove_segment(name_file: Path) -> None:
    """Remove the stand-in's segment if the test left it (a failure midway)."""
    if name_file.exists() and name_file.read_text():
        Path("/dev/shm", name_file.read_text()).unlink(missing_ok=True)
