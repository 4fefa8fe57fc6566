"""Shared-memory segments and the engine-side mapping cache (real memfds, this process as both sides)."""

from __future__ import annotations

import os

import pytest
import torch

from checkpoint_engine.transport.shm import MappingCache, Segment, SegmentRef, map_readonly


def _filled(nbytes: int, value: int) -> Segment:
    seg = Segment(nbytes, "test")
    seg.tensor.fill_(value)
    return seg


def test_map_readonly_sees_the_writers_bytes_and_rejects_a_short_segment():
    seg = _filled(4096, 7)
    try:
        view = map_readonly(seg.ref)
        assert torch.all(view == 7)
        seg.tensor[:10] = 9  # shared: later writes show through the engine's mapping
        assert view[:10].tolist() == [9] * 10
        with pytest.raises(RuntimeError, match="has 4096 bytes, expected 8192"):
            map_readonly(SegmentRef(seg.ref.pid, seg.ref.fd, 8192))
    finally:
        seg.close()


def test_map_readonly_names_a_missing_segment():
    with pytest.raises(RuntimeError, match="is gone"):
        map_readonly(SegmentRef(os.getpid(), 987654, 4096))


def test_cache_reuses_a_mapping_while_the_segment_is_the_same():
    seg = _filled(4096, 1)
    cache = MappingCache()
    try:
        first = cache.open(seg.ref)
        cache.end_update()
        second = cache.open(seg.ref)
        assert second is first and (cache.hits, cache.misses) == (1, 1)
        seg.tensor[0] = 5
        assert int(second[0]) == 5
    finally:
        seg.close()


def test_cache_maps_afresh_when_the_descriptor_number_now_names_another_segment():
    cache = MappingCache()
    old = _filled(4096, 1)
    ref = old.ref
    assert int(cache.open(ref)[0]) == 1
    old.close()
    new = _filled(4096, 2)  # the lowest free descriptor: usually the number the old one had
    try:
        if new.ref.fd != ref.fd:
            pytest.skip("the kernel did not reuse the descriptor number")
        assert int(cache.open(new.ref)[0]) == 2  # a stale mapping would still read 1
        assert (cache.hits, cache.misses) == (0, 2)
    finally:
        new.close()


@pytest.mark.parametrize(
    "keep_updates, used_in, alive_after",
    [
        # after update u ends, the mappings used by updates u-keep+1 .. u stay
        (1, [0], {0: True, 1: False}),
        (2, [0], {0: True, 1: True, 2: False}),
        (2, [0, 1], {1: True, 2: True, 3: False}),
        (3, [0, 2], {2: True, 4: True, 5: False}),
    ],
)
def test_cache_drops_mappings_unused_for_keep_updates(keep_updates, used_in, alive_after):
    seg = _filled(4096, 3)
    cache = MappingCache(keep_updates=keep_updates)
    try:
        for update in range(max(alive_after) + 1):
            if update in used_in:
                cache.open(seg.ref)
            cache.end_update()
            if update in alive_after:
                assert (len(cache) == 1) == alive_after[update], f"after update {update}"
    finally:
        seg.close()


def test_cache_rejects_a_bad_keep_count():
    with pytest.raises(ValueError, match="keep_updates"):
        MappingCache(keep_updates=0)
