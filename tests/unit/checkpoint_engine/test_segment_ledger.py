"""The ledger of an engine tree's shared-memory segments and the sweep that removes what killed
trees left (checkpoint_engine.engines.segment_ledger)."""

import json
import os
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

import psutil
import pytest

from checkpoint_engine.engines.segment_ledger import SegmentLedger, sweep


def _segment() -> shared_memory.SharedMemory:
    seg = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(seg._name, "shared_memory")  # removed by the test, not at exit
    return seg


def _path(seg: shared_memory.SharedMemory) -> str:
    return f"/dev/shm/{seg.name.lstrip('/')}"


def _gone_owner() -> dict:
    """A process that ran and ended: its pid and create time (what a killed holder's file names)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    child.wait(30)
    return {"pid": child.pid, "created": created}


def test_the_file_keeps_the_noted_segments_until_they_are_removed(tmp_path):
    ledger = SegmentLedger("engine-r0", str(tmp_path / "ledgers"))
    ledger.note({"/dev/shm/psm_b", "/dev/shm/psm_a"})
    record = json.loads(open(ledger.path).read())
    assert record["segments"] == ["/dev/shm/psm_a", "/dev/shm/psm_b"] and record["pid"] == os.getpid()
    assert oct(os.stat(tmp_path / "ledgers").st_mode & 0o777) == "0o700"
    assert ledger.unlink() == []  # none of them exists
    assert not os.path.exists(ledger.path) and not ledger.segments
    assert ledger.unlink() == []  # nothing to remove: no error
    with pytest.raises(ValueError, match="file name"):
        SegmentLedger("a/b", str(tmp_path))


def test_sweep_removes_what_gone_holders_left_and_nobody_maps(tmp_path):
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir(mode=0o700)
    left, mapped, other_file = _segment(), _segment(), tmp_path / "psm_not_in_dev_shm"
    left_path, mapped_path = _path(left), _path(mapped)
    left.close()  # unmapped: only the file is left, as after a SIGKILL
    other_file.write_text("x")
    try:
        gone = _gone_owner()
        listed = [left_path, mapped_path, str(other_file), "/dev/shm/psm_never_made", "/etc/passwd"]
        (ledgers / "1-engine-r0.json").write_text(json.dumps({**gone, "segments": listed}))
        live = SegmentLedger("engine-r1", str(ledgers))  # this process's: its holder runs
        live.note({"/dev/shm/psm_of_a_live_holder"})
        (ledgers / "2-broken.json").write_text("{not json")

        assert sweep(str(ledgers)) == [left_path]
        assert not os.path.exists(left_path)
        assert os.path.exists(mapped_path) and other_file.exists() and os.path.exists("/etc/passwd")
        # the segment still mapped stays listed for a later sweep; the broken file is gone; a live
        # holder's file is not touched
        assert json.loads((ledgers / "1-engine-r0.json").read_text())["segments"] == [mapped_path]
        assert not (ledgers / "2-broken.json").exists()
        assert json.loads(open(live.path).read())["segments"] == ["/dev/shm/psm_of_a_live_holder"]
        mapped.close()  # now nobody maps it: the next sweep removes it and the gone holder's file
        assert sweep(str(ledgers)) == [mapped_path]
        assert not os.path.exists(mapped_path) and not (ledgers / "1-engine-r0.json").exists()
        assert sweep(str(ledgers)) == [] and sweep(str(tmp_path / "none")) == []
    finally:
        for path in (left_path, mapped_path):
            if os.path.exists(path):
                os.unlink(path)


def test_sweep_refuses_a_folder_others_may_write(tmp_path):
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    os.chmod(ledgers, 0o777)
    seg = _segment()
    seg.close()
    try:
        (ledgers / "1-engine-r0.json").write_text(json.dumps({**_gone_owner(), "segments": [_path(seg)]}))
        assert sweep(str(ledgers)) == [] and os.path.exists(_path(seg))
    finally:
        os.unlink(_path(seg))
