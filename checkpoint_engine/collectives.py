"""Small collectives over the PS process group that carry bytes without pickle."""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist


def all_gather_bytes(data: bytes, world_size: int, group: dist.ProcessGroup | None = None) -> list[bytes]:
    if world_size == 1:
        return [data]
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, n, group=group)
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(max(width, 1), dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t[: int(s.item())].numpy().tobytes()) for t, s in zip(out, sizes)]


def all_gather_obj(obj, world_size: int, group: dist.ProcessGroup | None = None) -> list:
    """all_gather of msgpack-able values (no pickle)."""
    raw = all_gather_bytes(msgpack.packb(obj, use_bin_type=True), world_size, group)
    return [msgpack.unpackb(r, raw=False, strict_map_key=False) for r in raw]
