"""Delta updates through the existing update path: a delta travels as a checkpoint of its own.

Every transport, bucket plan and engine link works unchanged: the sender registers either the new
version's tensors (a full update) or the delta's wire tensors (a header and each tensor's payload
parts) under the version's name, and the engine's load function hands the delta's tensors to a
`DeltaReceiver`, which applies them once the update's last bucket is in (`finish`, the engine's
post hook, before its final Ack), checking every tensor's base checksum before writing any.

    sender: DeltaSender.prepare(version, new weights in the engine dtype, engine's checkpoint)
        choose_update ─▶ full: the new tensors, named as the model's (the first version, a skipped
                         one, an anchor every `anchor_every` versions, a delta not small enough)
                      ─▶ delta: "__ce_delta__" (JSON: base, version, per tensor: encoding, shape,
                         dtype, changed count, CRC-32 of base and new, part count, gap width,
                         which parts are zstd frames)
                         + "<name>::delta<i>" (the encoding's payload tensors, or their zstd frames)
        ─▶ register under `version`, update the engines ─▶ commit(): this version is the next base
        an engine that refuses the delta (its weights are not the base: DeltaMismatch, nothing
        written) fails the update; `DeltaSync.push` then sends the full version and says why
    engine: load fn ─▶ DeltaReceiver.take(name, tensor): a delta tensor? (copied: it is small)
            post hook ─▶ DeltaReceiver.finish(weights, held checkpoint): apply_sliced

The sender keeps the last version it sent in the engine dtype (one more copy of the model in host
memory); the header is JSON, never pickle.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from checkpoint_engine.sharding.delta import (
    DeltaMismatch,
    TensorDelta,
    UpdateChoice,
    VersionDelta,
    choose_update,
)
from checkpoint_engine.sharding.delta_slices import apply_sliced, encode_sliced, overlaps, parse_slice_key
from checkpoint_engine.sharding.slices import SourceSlice
from checkpoint_engine.state import EngineWeightState

logger = logging.getLogger(__name__)

HEADER = "__ce_delta__"  # one per sender rank when several register a share: "__ce_delta__/<rank>"
PART = "::delta"  # "<entry>::delta<i>": part i of the entry's payload (an entry: a tensor, or a slice of it)


def is_delta_name(name: str) -> bool:
    """Whether `name` is a delta's wire tensor (a header or a payload part), not a model tensor."""
    return name == HEADER or name.startswith(HEADER + "/") or PART in name


def entry_of_part(name: str) -> str:
    """The entry (`delta_slices.slice_key`) whose payload the wire tensor `name` carries."""
    return name.rpartition(PART)[0]


def to_wire(delta: VersionDelta, base_version: str, version: str, *, header: str = HEADER) -> dict[str, torch.Tensor]:
    """The delta as named tensors: the JSON header first (named `header`: a sender rank of several
    names its own), then each entry's payload parts."""
    if not (header == HEADER or header.startswith(HEADER + "/")):
        raise ValueError(f"a delta header is named {HEADER!r} or {HEADER + '/<rank>'!r}, not {header!r}")
    meta = {
        "base": base_version,
        "version": version,
        "tensors": {
            name: {
                "encoding": d.encoding,
                "shape": list(d.shape),
                "dtype": d.dtype,
                "num_changed": d.num_changed,
                "base_checksum": d.base_checksum,
                "new_checksum": d.new_checksum,
                "parts": len(d.payload),
                "gap_width": d.gap_width,
                "compressed": list(d.compressed),
            }
            for name, d in delta.tensors.items()
        },
    }
    out = {header: torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)}
    for name, d in delta.tensors.items():
        for i, part in enumerate(d.payload):
            out[f"{name}{PART}{i}"] = part
    return out


def from_wire(
    tensors: Mapping[str, torch.Tensor], takes: Callable[[str], bool] | None = None
) -> tuple[str, str, VersionDelta]:
    """(base version, version, delta) from `to_wire`'s tensors (every sender rank's header merged);
    DeltaMismatch naming what is missing. `takes(entry)`: only those entries (a tensor-parallel
    rank's own slices; the others' parts were never read); None: every entry."""
    headers = sorted(n for n in tensors if n == HEADER or n.startswith(HEADER + "/"))
    if not headers:
        raise DeltaMismatch(f"a delta update without its header {HEADER!r}")
    try:
        versions: set[tuple[str, str]] = set()
        entries: dict[str, dict] = {}
        for name in headers:
            one = json.loads(bytes(tensors[name].numpy()).decode())
            versions.add((str(one["base"]), str(one["version"])))
            for key, h in one["tensors"].items():
                if key in entries:
                    raise DeltaMismatch(f"delta entry {key!r} is in two headers")
                entries[key] = h
        if len(versions) != 1:
            raise DeltaMismatch(f"the delta's headers disagree on (base, version): {sorted(versions)}")
        ((base, version),) = versions
        out: dict[str, TensorDelta] = {}
        for name, h in entries.items():
            if takes is not None and not takes(name):
                continue
            parts = []
            for i in range(int(h["parts"])):
                part = tensors.get(f"{name}{PART}{i}")
                if part is None:
                    raise DeltaMismatch(f"tensor {name!r}: delta part {i} did not arrive")
                parts.append(part)
            out[name] = TensorDelta(
                str(h["encoding"]),
                tuple(int(x) for x in h["shape"]),
                str(h["dtype"]),
                tuple(parts),
                int(h["num_changed"]),
                int(h["base_checksum"]),
                int(h["new_checksum"]),
                int(h.get("gap_width", 0)),
                tuple(_flag(x) for x in h.get("compressed", [])),
            )
        return base, version, VersionDelta(out)
    except DeltaMismatch:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise DeltaMismatch(f"unreadable delta header: {type(e).__name__}: {e}") from None


def _flag(x: object) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"a compression flag is {x!r}, not true or false")
    return x


class RankSlices:
    """A tensor-parallel engine rank's slices, as its engine reads learn them, and which of a sliced
    delta's wire tensors it takes: the `Slices` callable of `EngineReads.set_slices`, wrapped.

    `probe` answers for model tensors ((name, dtype, shape) -> this rank's slices, () for none); its
    answers are kept, so a later delta (whose wire tensors name entries, not tensors) is read only
    where its entries overlap them. A delta tensor never reaches `probe` (a model's loaders would
    refuse the unknown name and make the whole batch whole)."""

    def __init__(self, probe: Callable[[list], Mapping[str, tuple[SourceSlice, ...]]]):
        self._probe = probe
        self._own: dict[str, tuple[SourceSlice, ...]] = {}

    def __call__(self, items: list) -> dict[str, tuple[SourceSlice, ...]]:
        plain = [item for item in items if not is_delta_name(item[0])]
        out = dict(self._probe(plain)) if plain else {}
        self._own.update(out)
        for name, _, _ in items:
            if is_delta_name(name):
                out[name] = (SourceSlice(name),) if self.takes_wire(name) else ()
        return out

    def own(self, name: str) -> tuple[SourceSlice, ...] | None:
        """This rank's slices of model tensor `name` (() none; None: no read asked about it yet)."""
        return self._own.get(name)

    def takes(self, entry: str) -> bool:
        """Whether this rank takes delta entry `entry`: it overlaps one of the rank's slices (an entry of
        a tensor it was never asked about is taken: the apply then names it)."""
        s = parse_slice_key(entry)
        held = self._own.get(s.name)
        return held is None or any(overlaps(s, o) for o in held)

    def takes_wire(self, name: str) -> bool:
        """`takes` for a wire tensor: every header, and the parts of entries this rank takes."""
        return PART not in name or self.takes(entry_of_part(name))


class DeltaReceiver:
    """Engine side of one update: keeps the delta's tensors as they arrive, applies them at the end.
    `rank_slices`: a tensor-parallel rank's (it keeps and applies only its own slices' entries)."""

    def __init__(self, rank_slices: RankSlices | None = None) -> None:
        self._parts: dict[str, torch.Tensor] = {}
        self._rank_slices = rank_slices
        self._seen = False
        self.changed: set[str] = set()  # after `finish`: the tensors whose values it changed

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """True when `name` belongs to a delta (kept, copied, when it is this rank's: the bucket's
        buffer is reused after its Ack; another rank's part was never read and is dropped)."""
        if not is_delta_name(name):
            return False
        self._seen = True
        if self._rank_slices is None or self._rank_slices.takes_wire(name):
            self._parts[name] = tensor.detach().to("cpu", copy=True)
        return True

    @property
    def is_delta(self) -> bool:
        return self._seen

    def finish(
        self,
        weights: Mapping[str, torch.Tensor],
        held_checkpoint: str | None,
        state: EngineWeightState | None = None,
        *,
        sliced: bool = False,
    ) -> str | None:
        """Apply the delta to `weights` (nothing written unless every base checksum matches); the
        version it brings, or None when this update was not a delta. `state` (the engine's, receiving
        this update): it then names that version as the checkpoint the engine will hold, whatever the
        delta was sent as (the daemon sends `policy-vN.delta` beside the full `policy-vN`). `sliced`:
        `weights` hold only this rank's slices (a sharded pull): only its entries are applied, and
        they must cover those slices."""
        if not self._seen:
            return None
        rank = self._rank_slices if sliced else None
        base, version, delta = from_wire(self._parts, rank.takes if rank is not None else None)
        if held_checkpoint != base:
            raise DeltaMismatch(f"the delta to {version!r} is from {base!r}, but this engine holds {held_checkpoint!r}")
        if sliced and rank is None:
            raise DeltaMismatch("this rank holds only its slices of the weights, and no slice plan to apply a delta by")
        apply_sliced(weights, delta, rank.own if rank is not None else None)
        self.changed = {parse_slice_key(key).name for key, d in delta.tensors.items() if d.num_changed}
        self._parts, self._seen = {}, False
        if state is not None:
            state.name_pending(version)
        return version


@dataclass(frozen=True)
class Prepared:
    """One version, ready to register: `tensors` (the full version or the delta's wire form)."""

    version: str
    choice: UpdateChoice
    tensors: dict[str, torch.Tensor]
    new: Mapping[str, torch.Tensor]  # the version itself (the next base once committed)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class DeltaSender:
    """Sender side: the base (the last version sent, in the engine dtype) and the full-or-delta choice.

    `anchor_every`: a full version every that many versions (None: only when a delta does not pay);
    `compress`: zstd each delta payload part, kept where smaller (checkpoint_engine.sharding.delta);
    `slices`: per tensor, the distinct slices the engine's tensor-parallel ranks consume
    (`delta_slices.delta_slices(plan)`): each is encoded on its own, so a rank that reads only its
    slices takes only their changed values (None: whole tensors, for engines that hold whole tensors)."""

    def __init__(
        self,
        max_ratio: float = 0.5,
        *,
        anchor_every: int | None = None,
        compress: bool = True,
        slices: Mapping[str, tuple[SourceSlice, ...]] | None = None,
    ) -> None:
        choose_update("v", "v", 0, 1, max_ratio, anchor_every=anchor_every)  # checks both, names the bad one
        self.max_ratio, self.anchor_every, self.compress = max_ratio, anchor_every, compress
        self.slices = slices
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version: str | None = None
        self.deltas_since_full = 0  # deltas committed since the last full version

    def prepare(self, version: str, new: Mapping[str, torch.Tensor], engine_checkpoint: str | None) -> Prepared:
        """What to send an engine holding `engine_checkpoint` so that it holds `new` as `version`."""
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        policy = {"deltas_since_full": self.deltas_since_full, "anchor_every": self.anchor_every}
        # what does not depend on the delta's size first: no delta is encoded for a full version
        choice = choose_update(engine_checkpoint, self.base_version, 0, full_bytes, self.max_ratio, **policy)
        if self.base is None or choice.kind == "full":
            if self.base is None and choice.kind == "delta":
                choice = UpdateChoice("full", "this version has no delta (no base version kept)")
            return Prepared(version, choice, dict(new), new)
        delta = encode_sliced(self.base, new, self.slices, compress=self.compress)
        choice = choose_update(engine_checkpoint, self.base_version, delta.nbytes, full_bytes, self.max_ratio, **policy)
        tensors = to_wire(delta, self.base_version, version) if choice.kind == "delta" else dict(new)
        return Prepared(version, choice, tensors, new)

    def full(self, prepared: Prepared, reason: str) -> Prepared:
        """The same version as a full update (after an engine refused the delta)."""
        return Prepared(prepared.version, UpdateChoice("full", reason), dict(prepared.new), prepared.new)

    def commit(self, prepared: Prepared) -> None:
        """The engines hold `prepared.version`: it is the next delta's base (copied: the caller's
        tensors may change with the next training step)."""
        self.base = {n: t.detach().to("cpu", copy=True) for n, t in prepared.new.items()}
        self.base_version = prepared.version
        self.deltas_since_full = self.deltas_since_full + 1 if prepared.choice.kind == "delta" else 0


@dataclass(frozen=True)
class Pushed:
    version: str
    kind: str  # what the engines finally took: "delta" | "full"
    reason: str  # why (a fallback names what refused the delta)
    nbytes: int  # bytes of what was registered and sent last
    tried_delta: bool


class DeltaSync:
    """Pushes versions through a ParameterServer (one rank here), delta where it pays, full where not.

    `engine_checkpoint()` says which version the engine holds (its weights_state's "checkpoint");
    `anchor_every`, `compress`: DeltaSender's.
    """

    def __init__(
        self,
        ps,
        req_func: Callable,
        engine_checkpoint: Callable[[], str | None],
        max_ratio: float = 0.5,
        *,
        anchor_every: int | None = None,
        compress: bool = True,
    ):
        self.ps, self.req_func, self.engine_checkpoint = ps, req_func, engine_checkpoint
        self.sender = DeltaSender(max_ratio, anchor_every=anchor_every, compress=compress)

    def _send(self, prepared: Prepared) -> None:
        name = prepared.version
        self.ps.register_checkpoint(name, named_tensors=prepared.tensors)
        try:
            self.ps.gather_metas(name)
            self.ps.update(name, self.req_func)
        finally:
            self.ps.unregister_checkpoint(name)

    def push(self, version: str, new: Mapping[str, torch.Tensor]) -> Pushed:
        prepared = self.sender.prepare(version, new, self.engine_checkpoint())
        tried_delta = prepared.choice.kind == "delta"
        if tried_delta:
            try:
                self._send(prepared)
            except Exception as e:  # noqa: BLE001 - the engine refused the delta: send the whole version
                reason = f"the engine refused the delta ({e}); sent the full version"
                logger.warning("version %s: %s", version, reason)
                prepared = self.sender.full(prepared, reason)
                self._send(prepared)
        else:
            logger.info("version %s: full update: %s", version, prepared.choice.reason)
            self._send(prepared)
        self.sender.commit(prepared)
        return Pushed(version, prepared.choice.kind, prepared.choice.reason, prepared.nbytes, tried_delta)
