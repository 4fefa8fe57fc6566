"""The shared-memory segments an engine's process tree maps, written down, so that the next start
removes what a tree killed whole left behind.

Whoever stops a vLLM process tree notes the segments it maps and removes those its killed processes
could not (``procs``). When that holder is SIGKILLed along with the tree (``kill -9`` of every
process, a batch system's kill once its grace period is over), nothing of ours is left to remove
them, and each keeps its memory until the machine reboots. So a holder also keeps what it noted in a
file of its own (``SegmentLedger``), and a holder's start first sweeps the files of holders that are
gone (``sweep``): each segment listed there that still exists and that no live process maps is
removed.

    holder notes segments ──note(noted)──▶ <dir>/<pid>-<name>.json {"pid", "created", "segments"}
    holder's stop ──unlink()──▶ what is left of them removed, the file too
    holder SIGKILLed ──the file stays──▶ a later holder's start: sweep() ──owner gone, nobody maps
                                         the segment──▶ unlink; segments still mapped stay listed

The folder is per user (mode 0700); a listed path is removed only when it is a segment directly in
``/dev/shm`` with one of ``procs.SHM_PREFIXES``, so an edited file cannot make the sweep remove
anything else.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable

from ckpt_common.procs import SHM_DIR, SHM_PREFIXES, live_pids, shm_segments, unlink_segments

logger = logging.getLogger(__name__)


def default_dir() -> str:
    """`<tempdir>/ckpt-engine-<uid>/segments`: one folder per user, shared by every holder of that user."""
    return os.path.join(tempfile.gettempdir(), f"ckpt-engine-{os.getuid()}", "segments")


def _private_dir(directory: str) -> str:
    """Make `directory` (0700) if needed; refuse one that another user owns or others may write."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} is not a private folder of this user (uid {os.getuid()})")
    return directory


def _removable(path: str) -> bool:
    """A segment directly in SHM_DIR with one of our prefixes."""
    head, name = os.path.split(path)
    return head == SHM_DIR and name.startswith(SHM_PREFIXES) and name not in (".", "..")


class SegmentLedger:
    """The segments one holder noted and has not removed yet, mirrored in a file of its own (`name`
    tells holders of one process apart, e.g. "engine-r0")."""

    def __init__(self, name: str, directory: str | None = None):
        if not name or "/" in name:
            raise ValueError(f"SegmentLedger name {name!r} must be a non-empty file name")
        import psutil

        self.directory = directory or default_dir()
        self.path = os.path.join(self.directory, f"{os.getpid()}-{name}.json")
        self._owner = {"pid": os.getpid(), "created": psutil.Process().create_time()}
        self._segments: set[str] = set()
        self._warned = False

    @property
    def segments(self) -> frozenset[str]:
        return frozenset(self._segments)

    def note(self, segments: Iterable[str]) -> None:
        """Add `segments`; the file is rewritten only when one of them is new."""
        new = set(segments) - self._segments
        if new:
            self._segments |= new
            self._write()

    def unlink(self) -> list[str]:
        """Remove the noted segments that still exist (`procs.unlink_segments`: what killed processes
        could not), forget them all and remove the file. Returns those removed."""
        removed = unlink_segments(self._segments)
        self._segments = set()
        self._write()
        return removed

    def _write(self) -> None:
        """The file holds the noted segments; none: no file. A file that cannot be written is logged
        once: the holder's own stop still removes the segments."""
        try:
            if not self._segments:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                return
            _private_dir(self.directory)
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump({**self._owner, "segments": sorted(self._segments)}, f)
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                logger.warning("could not keep the engine's shared-memory segments in %s: %s", self.path, e)
                self._warned = True


def _read(path: str) -> tuple[dict[int, float], list[str]] | None:
    """({owner pid: create time}, segments) of one ledger file; None when it is not one."""
    try:
        with open(path) as f:
            record = json.load(f)
        owner = {int(record["pid"]): float(record["created"])}
        segments = record["segments"]
        if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments):
            return None
        return owner, segments
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mapped_now() -> set[str]:
    """The segments (SHM_DIR/<prefix>*) that any process this user can read maps now."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    return shm_segments(pids)


def sweep(directory: str | None = None) -> list[str]:
    """Remove the segments that gone holders listed and no live process maps; returns those removed.
    A file of a live holder is left alone; a gone holder's file is removed once nothing in it is left
    (segments still mapped, e.g. by a process of that tree still stopping, stay listed for a later
    sweep); an unreadable file is removed with a warning."""
    directory = directory or default_dir()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    try:
        _private_dir(directory)
    except OSError as e:
        logger.warning("not sweeping shared-memory ledgers: %s", e)
        return []
    stale: list[tuple[str, dict[int, float], list[str]]] = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        read = _read(path)
        if read is None:
            logger.warning("removing %s: not a ledger of shared-memory segments", path)
            _unlink(path)
            continue
        owner, segments = read
        if not live_pids(owner):
            stale.append((path, owner, segments))
    if not stale:
        return []
    mapped = _mapped_now()
    removed: list[str] = []
    for path, owner, segments in stale:
        left = []
        for seg in segments:
            if not _removable(seg):
                logger.warning("%s lists %s, not a segment of ours in %s: left alone", path, seg, SHM_DIR)
            elif seg in mapped:
                left.append(seg)
            elif _unlink(seg):
                removed.append(seg)
        if left:
            pid, created = next(iter(owner.items()))
            try:
                with open(path, "w") as f:
                    json.dump({"pid": pid, "created": created, "segments": left}, f)
            except OSError as e:
                logger.warning("could not update %s: %s", path, e)
        else:
            _unlink(path)
    if removed:
        logger.info("removed %d shared-memory segments that killed engines left: %s", len(removed), removed)
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("could not remove %s: %s", path, e)
        return False
