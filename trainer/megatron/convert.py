"""HF Qwen2 <-> Megatron-core state dicts: pure functions on dicts of tensors (no megatron import).

Both directions, and ``rank_slices`` (what one rank contributes, as views), walk the one piece
table of ``ckpt_common.layout.pieces``, so they cannot disagree:

    HF state dict ──hf_to_megatron──▶ {(pp, tp): Megatron state dict}      (trainer init from SFT)
    {(pp, tp): Megatron state dict} ──megatron_to_hf(out=host views)──▶ HF  (weight sync)
    (MoE with ep_size > 1: the rank keys are (pp, tp, ep); see ckpt_common.layout.shapes.Parallelism.rank_of)
    one rank's Megatron state dict ──rank_slices──▶ [(Piece, view)]        (sharding-aware plans)
    one rank's Megatron state dict ──write_rank_slices──▶ its slices of a shared HF buffer (weight sync)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from ckpt_common.layout.pieces import conversion_pieces, hf_sources, writer_pieces
from ckpt_common.layout.shapes import (
    ModelShape,
    NormStyle,
    Parallelism,
    Piece,
    Rank,
)


def _check_hf(state_dict: Mapping[str, torch.Tensor], names: set[str]) -> None:
    missing = sorted(names - set(state_dict))
    extra = sorted(set(state_dict) - names)
    if missing or extra:
        raise ValueError(
            f"HF state dict does not match the shape: missing={missing[:5]} "
            f"({len(missing)}), unexpected={extra[:5]} ({len(extra)})"
        )


def hf_to_megatron(
    state_dict: Mapping[str, torch.Tensor],
    shape: ModelShape,
    parallel: Parallelism,
    norm_style: NormStyle = "local",
    ranks: list[Rank] | None = None,
    copy_threads: int | None = 1,
) -> dict[Rank, dict[str, torch.Tensor]]:
    """HF state dict -> {(pp_rank, tp_rank): Megatron state dict} (new contiguous tensors).

    ``ranks`` limits the output to some ranks (a trainer rank converts only its own).
    ``copy_threads``: see ``copy_threads_context``."""
    pieces = conversion_pieces(shape, parallel, norm_style)
    _check_hf(state_dict, {p.hf_name for p in pieces})
    wanted = set(parallel.ranks() if ranks is None else ranks)
    sizes: dict[tuple[Rank, str], int] = {}
    ref: dict[tuple[Rank, str], Piece] = {}
    for p in pieces:
        key = (parallel.rank_of(p), p.mg_name)
        sizes[key] = max(sizes.get(key, 0), p.mg_start + p.length)
        ref.setdefault(key, p)
    out: dict[Rank, dict[str, torch.Tensor]] = {rank: {} for rank in sorted(wanted)}
    for (rank, mg_name), size in sizes.items():
        if rank not in wanted:
            continue
        template = state_dict[ref[(rank, mg_name)].hf_name]
        dims = list(template.shape)
        dims[ref[(rank, mg_name)].dim] = size
        out[rank][mg_name] = torch.empty(dims, dtype=template.dtype, device=template.device)
    with copy_threads_context(copy_threads):
        for p in pieces:
            rank = parallel.rank_of(p)
            if rank in wanted:
                src = state_dict[p.hf_name].narrow(p.dim, p.hf_start, p.length)
                out[rank][p.mg_name].narrow(p.dim, p.mg_start, p.length).copy_(src)
    return out


def megatron_to_hf(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]],
    shape: ModelShape,
    parallel: Parallelism,
    norm_style: NormStyle = "local",
    out: Mapping[str, torch.Tensor] | None = None,
    copy_threads: int | None = 1,
) -> dict[str, torch.Tensor]:
    """{(pp_rank, tp_rank): Megatron state dict} -> HF state dict (TP shards merged, PP stages joined).

    ``out``: preallocated HF tensors to write into (e.g. views of the checkpoint engine's host
    memory, so the conversion is the only copy); names it lacks are allocated. Extra Megatron keys
    (``_extra_state``, RoPE buffers) are ignored; a missing tensor raises. ``copy_threads``: see
    ``copy_threads_context``."""
    sources = hf_sources(shape, parallel, norm_style)
    result: dict[str, torch.Tensor] = {}
    with copy_threads_context(copy_threads):
        for hf_name, pieces in sources.items():
            result[hf_name] = _merge_into(shards, hf_name, pieces, out, parallel)
    return result


def _merge_into(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]],
    hf_name: str,
    pieces: list[Piece],
    out: Mapping[str, torch.Tensor] | None,
    parallel: Parallelism,
) -> torch.Tensor:
    first = _megatron_tensor(shards, pieces[0], parallel)
    dims = list(first.shape)
    dims[pieces[0].dim] = sum(p.length for p in pieces)
    tensor = None if out is None else out.get(hf_name)
    if tensor is None:
        tensor = torch.empty(dims, dtype=first.dtype, device=first.device)
    elif list(tensor.shape) != dims or tensor.dtype != first.dtype:
        raise ValueError(
            f"out[{hf_name!r}] is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(dims)} {first.dtype}"
        )
    for p in pieces:
        tensor.narrow(p.dim, p.hf_start, p.length).copy_(
            _megatron_tensor(shards, p, parallel).narrow(p.dim, p.mg_start, p.length)
        )
    return tensor


def rank_slices(
    shard: Mapping[str, torch.Tensor],
    shape: ModelShape,
    parallel: Parallelism,
    rank: Rank,
    norm_style: NormStyle = "local",
) -> list[tuple[Piece, torch.Tensor]]:
    """What one Megatron rank contributes to the HF checkpoint, without any copy or communication:
    (piece, view of this rank's tensor) for every primary piece it owns. The piece says which HF
    tensor and which slice along ``piece.dim`` the view fills (input for a sharding-aware plan)."""
    pieces = writer_pieces(shape, parallel, norm_style).get(rank)
    if pieces is None:
        raise ValueError(f"rank {rank} is outside {parallel}")
    return [(p, _megatron_tensor({rank: shard}, p, parallel).narrow(p.dim, p.mg_start, p.length)) for p in pieces]


def write_rank_slices(
    shard: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
    shape: ModelShape,
    parallel: Parallelism,
    rank: Rank,
    norm_style: NormStyle = "local",
    copy_threads: int | None = 1,
) -> int:
    """Write this rank's slices (``layout.writer_pieces``) into HF-layout tensors ``out`` (e.g. views
    of one shared-memory buffer every rank of the model writes its own part of): one copy per piece,
    casting to ``out``'s dtype on the way, nothing sent anywhere. Returns the bytes written.
    After every rank has written (and a barrier), ``out`` holds the whole HF checkpoint."""
    written = 0
    with copy_threads_context(copy_threads):
        for piece, src in rank_slices(shard, shape, parallel, rank, norm_style):
            dst = out.get(piece.hf_name)
            if dst is None:
                raise ValueError(f"out lacks {piece.hf_name} (rank {rank} writes part of it)")
            dst.narrow(piece.dim, piece.hf_start, piece.length).copy_(src)
            written += src.numel() * dst.element_size()
    return written


@contextlib.contextmanager
def copy_threads_context(num_threads: int | None):
    """Run the conversion's copies on ``num_threads`` torch threads (None: leave torch's setting).

    The copies are memory-bound: one thread reaches memcpy speed, while several threads pay an
    OpenMP hand-off per copy that costs milliseconds when the cores are busy (2-core machine,
    2 threads: 0.7 GiB/s instead of 6 GiB/s). The setting is process-wide for the duration, so
    do not convert while another thread of the process runs torch compute."""
    if num_threads is None:
        yield
        return
    if num_threads < 1:
        raise ValueError(f"copy_threads={num_threads!r} must be a positive int or None")
    before = torch.get_num_threads()
    if before == num_threads:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _megatron_tensor(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]], piece: Piece, parallel: Parallelism
) -> torch.Tensor:
    rank = parallel.rank_of(piece)
    where = f"pp={rank[0]}, tp={rank[1]}" + (f", ep={rank[2]}" if len(rank) > 2 else "")
    if rank not in shards:
        raise ValueError(f"no Megatron shard for rank ({where}), needed for {piece.hf_name}")
    tensor = shards[rank].get(piece.mg_name)
    if tensor is None:
        raise ValueError(f"Megatron shard ({where}) lacks {piece.mg_name} (needed for {piece.hf_name})")
    return tensor
