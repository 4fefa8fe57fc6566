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
            post hook ─▶ DeltaReceiver.finish(weights, held checkpoint): apply_version

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
    apply_version,
    choose_update,
    encode_version,
)
from checkpoint_engine.state import EngineWeightState

logger = logging.getLogger(__name__)

HEADER = "__ce_delta__"
PART = "::delta"  # "<name>::delta<i>": part i of the tensor's payload


def to_wire(delta: VersionDelta, base_version: str, version: str) -> dict[str, torch.Tensor]:
    """The delta as named tensors: the JSON header first, then each tensor's payload parts."""
    header = {
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
    out = {HEADER: torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)}
    for name, d in delta.tensors.items():
        for i, part in enumerate(d.payload):
            out[f"{name}{PART}{i}"] = part
    return out


def from_wire(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str, VersionDelta]:
    """(base version, version, delta) from `to_wire`'s tensors; DeltaMismatch naming what is missing."""
    if HEADER not in tensors:
        raise DeltaMismatch(f"a delta update without its header {HEADER!r}")
    try:
        header = json.loads(bytes(tensors[HEADER].numpy()).decode())
        out: dict[str, TensorDelta] = {}
        for name, h in header["tensors"].items():
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
        return str(header["base"]), str(header["version"]), VersionDelta(out)
    except DeltaMismatch:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise DeltaMismatch(f"unreadable delta header: {type(e).__name__}: {e}") from None


def _flag(x: object) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"a compression flag is {x!r}, not true or false")
    return x


class DeltaReceiver:
    """Engine side of one update: keeps the delta's tensors as they arrive, applies them at the end."""

    def __init__(self) -> None:
        self._parts: dict[str, torch.Tensor] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """True when `name` belongs to a delta (kept: the bucket's buffer is reused after its Ack)."""
        if name == HEADER or PART in name:
            self._parts[name] = tensor.detach().to("cpu", copy=True)
            return True
        return False

    @property
    def is_delta(self) -> bool:
        return bool(self._parts)

    def finish(
        self, weights: Mapping[str, torch.Tensor], held_checkpoint: str | None, state: EngineWeightState | None = None
    ) -> str | None:
        """Apply the delta to `weights` (nothing written unless every base checksum matches); the
        version it brings, or None when this update was not a delta. `state` (the engine's, receiving
        this update): it then names that version as the checkpoint the engine will hold, whatever the
        delta was sent as (the daemon sends `policy-vN.delta` beside the full `policy-vN`)."""
        if not self._parts:
            return None
        base, version, delta = from_wire(self._parts)
        if held_checkpoint != base:
            raise DeltaMismatch(f"the delta to {version!r} is from {base!r}, but this engine holds {held_checkpoint!r}")
        apply_version(weights, delta)
        self._parts = {}
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
    `compress`: zstd each delta payload part, kept where smaller (checkpoint_engine.sharding.delta)."""

    def __init__(self, max_ratio: float = 0.5, *, anchor_every: int | None = None, compress: bool = True) -> None:
        choose_update("v", "v", 0, 1, max_ratio, anchor_every=anchor_every)  # checks both, names the bad one
        self.max_ratio, self.anchor_every, self.compress = max_ratio, anchor_every, compress
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
        delta = encode_version(self.base, new, compress=self.compress)
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
