"""SlotProbe and skip_self_copies against a load function shaped like vLLM's: q/k/v copied into rows of a
fused qkv parameter, a plain parameter, a cast, a transpose, a narrowed source, and a name it skips."""

import torch

from vllm_ext.placement import SlotProbe, skip_self_copies


class Model:
    def __init__(self):
        self.qkv = torch.zeros(6, 4)  # q: rows 0-3, k: row 4, v: row 5
        self.norm = torch.zeros(4)
        self.half = torch.zeros(4, dtype=torch.float16)
        self.t = torch.zeros(3, 2)
        self.shard = torch.zeros(2)
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
                self.norm.copy_(w)
                self.norm.copy_(w)  # two copies: not a slot
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


def test_a_load_from_the_slots_themselves_copies_nothing_else_is_unchanged():
    m = Model()
    q, k, v, norm = SlotProbe(m.load)(ITEMS[:4])
    q.copy_(torch.arange(16.0).view(4, 4))  # what the engine's transfer engine would have written
    k.fill_(7)
    v.fill_(8)
    norm.fill_(3)
    t = torch.arange(6.0).view(2, 3)
    with skip_self_copies() as mode:
        m.load([("q", q), ("k", k), ("v", v), ("norm", norm), ("t", t)])
    assert mode.skipped == 4  # the four slots: their copies onto themselves did nothing
    assert torch.equal(m.qkv[:4], torch.arange(16.0).view(4, 4)) and (m.qkv[4] == 7).all() and (m.qkv[5] == 8).all()
    assert torch.equal(m.t, t.t())  # any other copy runs as usual
    assert m.loaded[-5:] == ["q", "k", "v", "norm", "t"]  # the loader saw every name (vLLM counts them)


def test_a_loader_that_refuses_stand_ins_gives_no_slots():
    def load(weights):
        raise ValueError("unexpected name")

    assert SlotProbe(load)(ITEMS[:2]) == [None, None]
