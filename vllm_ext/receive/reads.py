"""The bookkeeping of one update's reads that the engine does itself (a pull over the PS's "remote"
buffers, `checkpoint_engine.transport.engine_reads`): whether this update is one, which tensors the
reads put straight into their parameter slots (vLLM's load step, `vllm_ext.placement.SlotProbe`),
how many slots it had to probe, and whether the reads took only this rank's tensor-parallel slices."""

from __future__ import annotations

from checkpoint_engine.transport.engine_reads import EngineReads
from vllm_ext.placement import SlotProbe
from vllm_ext.receive.modes import NamedTensors


class ReadTally:
    """One update's engine reads. `probe`: the receiver's slot probe (None: none ran yet);
    `probed_ahead`: names whose slots were found before the update (`probe_ahead`)."""

    def __init__(self, reads: EngineReads, probe: SlotProbe | None, probed_ahead: int) -> None:
        self.reads = reads
        self.probe = probe
        self.remote = False  # the engine reads this update itself (remote buffers)
        self.num_loaded_by_read = 0  # bucket mode: tensors read into their slots, no loader run after
        self.probed_ahead = probed_ahead
        self._probed_before = probe.num_probed if probe is not None else 0

    def on_hello(self, hello) -> None:
        self.remote = any(h.kind == "remote" for h in hello.buffers)

    def unread(self, views: NamedTensors) -> NamedTensors:
        """The bucket's tensors that still need their loaders: a tensor read straight into its slot
        is loaded already (its loader ran, with the copy left out, in the probe)."""
        probe = self.probe if self.remote else None
        rest = views if probe is None else [(n, t) for n, t in views if not probe.holds(n, t)]
        self.num_loaded_by_read += len(views) - len(rest)
        return rest

    def probed_in_update(self) -> int:
        """Names whose slots this update had to find (0 when all were found ahead, or no probe ran)."""
        return self.probe.num_probed - self._probed_before if self.probe is not None else 0

    def sliced(self) -> bool:
        """Whether this update's reads took only this rank's tensor-parallel slices (a sharded pull)."""
        stats = self.reads.stats if self.remote else None
        return stats is not None and stats.sliced_tensors > 0

    def report(self) -> dict | None:
        """The reads' stats (`engine_reads` of the update's summary); None when the PS pushed."""
        return self.reads.stats.report() if self.remote else None
