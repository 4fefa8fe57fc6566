"""SlotProbe against a load function shaped like vLLM's: q/k/v copied into rows of a fused qkv parameter,
a plain parameter, a cast, a transpose, a narrowed source, a name it skips, and loaders that do more
than one copy (a padding row zeroed beside the slot, a scale applied to the slot, a statistic of the
weight)."""

import pytest
import torch

from vllm_ext.placement import RangeSet, SlotProbe, byte_range, overlapping


class Model:
    def __init__(self):
        self.qkv = torch.zeros(6, 4)  # q: rows 0-3, k: row 4, v: row 5
        self.norm = torch.zeros(4)
        self.half = torch.zeros(4, dtype=torch.float16)
        self.t = torch.zeros(3, 2)
        self.shard = torch.zeros(2)
        self.other = torch.zeros(4)
        self.calls = 0
        self.loaded: list[str] = []

    def load(self, weights):
        self.calls += 1
        rows = {"q": (0, 4), "k": (4, 1), "v": (5, 1)}
        for name, w in weights:
            self.loaded.append(name)
            if name in rows:
                start, n = rows[name]
                self.qkv.narrow(0, start, n).copy_(w)
            elif name == "norm":
                self.norm.copy_(w)
            elif name == "half":
                self.half.copy_(w)  # a cast: not a slot
            elif name == "t":
                self.t.copy_(w.t())  # a transpose: not a slot
            elif name == "shard":
                self.shard.copy_(w[2:])  # half of the source: not a slot
            elif name == "twice":
                self.other.copy_(w)
                self.other.copy_(w)  # two copies: not a slot
            # "ignored": the loader skips it (tied weights)


ITEMS = [
    ("q", torch.float32, (4, 4)),
    ("k", torch.float32, (1, 4)),
    ("v", torch.float32, (1, 4)),
    ("norm", torch.float32, (4,)),
    ("half", torch.float32, (4,)),
    ("t", torch.float32, (2, 3)),
    ("shard", torch.float32, (4,)),
    ("twice", torch.float32, (4,)),
    ("ignored", torch.float32, (4,)),
]


def test_slots_are_plain_whole_copies_only_and_nothing_is_written():
    m = Model()
    probe = SlotProbe(m.load)
    slots = dict(zip([n for n, _, _ in ITEMS], probe(ITEMS), strict=True))
    assert slots["q"].data_ptr() == m.qkv.data_ptr() and slots["q"].shape == (4, 4)
    assert slots["k"].data_ptr() == m.qkv[4].data_ptr() and slots["v"].data_ptr() == m.qkv[5].data_ptr()
    assert slots["norm"].data_ptr() == m.norm.data_ptr()
    assert all(slots[n] is None for n in ("half", "t", "shard", "twice", "ignored"))
    assert not m.qkv.any() and not m.norm.any()  # the probe copied nothing
    assert probe(ITEMS[:2])[0] is slots["q"] and m.calls == 1  # each name is probed once


def test_the_probe_is_the_slots_load_what_the_reads_write_is_the_model():
    m = Model()
    probe = SlotProbe(m.load)
    q, k, v, norm, t = probe(ITEMS[:4] + [ITEMS[5]])
    assert t is None
    q.copy_(torch.arange(16.0).view(4, 4))  # what the engine's transfer engine writes
    k.fill_(7)
    v.fill_(8)
    norm.fill_(3)
    assert all(probe.holds(n, s) for n, s in (("q", q), ("k", k), ("v", v), ("norm", norm)))
    assert not probe.holds("t", torch.zeros(2, 3)) and not probe.holds("q", q.clone())  # elsewhere: not loaded
    assert not probe.holds("q", m.qkv[:4].t())  # the slot's bytes seen another way: not its slot
    assert torch.equal(m.qkv[:4], torch.arange(16.0).view(4, 4)) and (m.qkv[4] == 7).all() and (m.qkv[5] == 8).all()
    assert m.loaded == ["q", "k", "v", "norm", "t"]  # the probe ran each loader (vLLM counts the names)


class Padded:
    """vLLM's vocabulary embedding: the checkpoint's rows copied in, the padding rows after them zeroed."""

    def __init__(self):
        self.embed = torch.full((6, 2), 5.0)  # 4 rows of the checkpoint, 2 of padding
        self.scaled = torch.zeros(4)
        self.stat = torch.zeros(())
        self.w = torch.zeros(4)
        self.zero_rows = torch.zeros(4, 2)

    def load(self, weights):
        for name, w in weights:
            if name == "embed":
                self.embed[:4].copy_(w)
                self.embed[4:].fill_(0)  # beside the slot: done once, in the probe
            elif name == "scaled":
                self.scaled.copy_(w)
                self.scaled.mul_(2)  # works on the slot after the copy: needs the real bytes
            elif name == "stat":
                self.w.copy_(w)
                self.stat.copy_(w.abs().max())  # computed from the weight
            elif name == "empty_pad":
                self.zero_rows.copy_(w)
                self.zero_rows[4:].fill_(1)  # no rows: touches nothing


def test_a_slot_only_when_no_other_op_reads_or_writes_its_bytes_or_the_weights():
    m = Padded()
    items = [
        ("embed", torch.float32, (4, 2)),
        ("scaled", torch.float32, (4,)),
        ("stat", torch.float32, (4,)),
        ("empty_pad", torch.float32, (4, 2)),
    ]
    embed, scaled, stat, empty_pad = SlotProbe(m.load)(items)
    assert embed is not None and embed.data_ptr() == m.embed.data_ptr()
    assert (m.embed[4:] == 0).all() and (m.embed[:4] == 5).all()  # the padding zeroed, the slot untouched
    assert scaled is None  # its loader scales the slot after the copy: loaded from scratch
    assert stat is None  # its loader computes from the weight: loaded from scratch
    assert empty_pad is not None


def test_byte_range_covers_every_element():
    base = torch.zeros(4, 6)
    start = base.data_ptr()
    assert byte_range(base) == (start, start + 96)
    assert byte_range(base[1:3]) == (start + 24, start + 72)
    assert byte_range(base[:, 2]) == (start + 8, start + 8 + 4 * (3 * 6 + 1))
    assert byte_range(base.t()) == (start, start + 96)
    assert byte_range(base[4:]) is None


def test_a_loader_that_refuses_stand_ins_gives_no_slots():
    def load(weights):
        raise ValueError("unexpected name")

    assert SlotProbe(load)(ITEMS[:2]) == [None, None]


@pytest.mark.parametrize(
    "ranges, expected",
    [
        ([], set()),
        ([(0, 4), (4, 8), (8, 12)], set()),  # touching, not sharing
        ([(0, 4), (3, 8)], {0, 1}),
        ([(0, 100), (1, 10), (20, 30)], {0, 1, 2}),  # one range holds two others
        ([(0, 10), (20, 30), (5, 6)], {0, 2}),  # out of order
        ([(0, 10), None, (0, 10)], {0, 2}),  # the same bytes twice; None: no elements
        ([(0, 10), (1, 5), (10, 12), (11, 13)], {0, 1, 2, 3}),
        ([(0, 10), (2, 50), (60, 70)], {0, 1}),
    ],
)
def test_overlapping_names_every_range_that_shares_a_byte(ranges, expected):
    assert overlapping(ranges) == expected


@pytest.mark.parametrize(
    "ranges, query, expected",
    [
        ([], (0, 10), False),
        ([(0, 4)], None, False),  # no elements: meets nothing
        ([(0, 4), (8, 12)], (4, 8), False),  # the gap between, touching both ends
        ([(0, 4), (8, 12)], (3, 5), True),
        ([(0, 4), (8, 12)], (7, 9), True),
        ([(8, 12), (0, 4)], (11, 20), True),  # out of order
        ([(0, 4), (4, 8)], (8, 9), False),  # adjacent ranges merged; just past the end
        ([(0, 4), (4, 8)], (5, 6), True),  # inside the second of two merged ranges
        ([(0, 100), (10, 20)], (50, 60), True),  # a range inside another: the outer one counts
        ([(10, 20)], (0, 100), True),  # the query holds a range
        ([(10, 20), (30, 40)], (20, 30), False),
    ],
)
def test_range_set_meets_a_range_sharing_a_byte(ranges, query, expected):
    assert RangeSet(ranges).meets(query) is expected
    brute = query is not None and any(lo < query[1] and query[0] < hi for lo, hi in ranges)
    assert brute is expected


def test_two_tensors_copied_into_the_same_bytes_get_no_slot():
    """Tied weights loaded from both names: which copy lands last is the loaders' order, which reads
    in flight at once would not keep."""
    embed = torch.zeros(4, 2)

    def load(weights):
        for _name, w in weights:
            embed.copy_(w)

    items = [("embed", torch.float32, (4, 2)), ("lm_head", torch.float32, (4, 2))]
    assert SlotProbe(load)(items) == [None, None]
    assert SlotProbe(load)(items[:1])[0] is not None  # alone it is a slot
