"""Who used the CPUs during a time window: a sampler of every process under a root (and of the
threads of the processes it is asked to look inside), for benchmarks whose timings depend on what
else runs on a few cores.

    trace = CpuTrace(os.getpid(), threads_of=("EngineCore",)).start()
    ...                                   # the work; remember each window's (start, end) wall times
    trace.window(t0, t1)                  # {"span_s", "machine_busy_cores", "cores": {label: cores}}
    CpuTrace.merge([trace.window(*w) for w in windows])   # time-weighted mean over several windows

A process's label is its daemon rank (LOCAL_RANK in its environment or its nearest ancestor's:
a rank's engines run without torchrun's variables) and its role: the `-m` module or script of a
Python process, else its name. Samples every `interval_s` (0.05 s: a window of 0.15 s is measured
over at most 0.25 s); each sample reads /proc once per process (and per thread looked inside),
~1-2% of one core here.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from array import array

MIN_CORES = 0.02  # labels using less are left out of a window's report


def _machine_busy_s() -> float:
    """Seconds of CPU time every core of the machine spent busy (not idle or iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def label_of(proc, names: dict[int, str]) -> str | None:
    """'r1:vllm_ext.launch', 'r0:VLLM::EngineCore', 'raw reader' (from `names`), ...; None when the
    process can no longer be read (it exited: a zombie has no command line and no environment)."""
    import psutil

    if proc.pid in names:
        return names[proc.pid]
    try:
        name, cmd = proc.name(), proc.cmdline()
        rank = proc.environ().get("LOCAL_RANK")
    except (psutil.Error, OSError):
        return None
    try:
        # engines run without torchrun's variables: they are labelled with their nearest ancestor's rank
        for p in proc.parents() if rank is None else ():
            rank = p.environ().get("LOCAL_RANK")
            if rank is not None:
                break
    except (psutil.Error, OSError):  # an ancestor that exited meanwhile: labelled without a rank
        pass
    role = name
    if name.startswith("python") and len(cmd) > 1:
        if "-m" in cmd[:-1]:
            role = cmd[cmd.index("-m") + 1]
        else:
            role = "/".join(cmd[1].split("/")[-2:])
    return f"r{rank}:{role}" if rank is not None else role


class CpuTrace:
    """Samples the CPU time of every process under `root` (see the module docstring)."""

    def __init__(
        self,
        root: int,
        *,
        names: dict[int, str] | None = None,
        threads_of: tuple[str, ...] = (),
        interval_s: float = 0.05,
        refresh_every: int = 10,
    ):
        self.root, self.names = root, dict(names or {})
        self.threads_of, self.interval_s, self.refresh_every = threads_of, interval_s, refresh_every
        self._procs: dict[int, object] = {}
        self._labels: dict[int, str] = {}  # relabelled at each refresh: a new process gets its title late
        self._thread_labels: dict[str, str] = {}  # "pid.tid" -> its process's label and the thread's name
        # (wall time, machine busy s, keys, cpu s of each key): a key is a pid or "pid.tid"; the tuple of
        # keys is shared by the samples between two changes of the process set (~1.6 KB a sample)
        self._samples: list[tuple[float, float, tuple[str, ...], array]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-trace", daemon=True)

    def start(self) -> CpuTrace:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _refresh(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root)
            found = {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            return
        self._procs = found
        for pid, p in found.items():  # a process forked, then exec'ed or titled, is labelled anew,
            # but one that exited keeps the label it had alive (its CPU time still counts under it)
            label = label_of(p, self.names)
            if label is not None or pid not in self._labels:
                self._labels[pid] = label or f"pid {pid}"

    def _sample(self) -> dict[str, float]:
        """{pid or "pid.tid": CPU seconds so far} of every process (and every thread looked inside)."""
        import psutil

        out: dict[str, float] = {}
        for pid, p in list(self._procs.items()):
            label = self._labels.get(pid, f"pid {pid}")
            try:
                t = p.cpu_times()
                # keyed by pid: a process that exits must not take its time out of its label's sum
                out[str(pid)] = t.user + t.system
                if any(k in label for k in self.threads_of):
                    for th in p.threads():
                        try:
                            with open(f"/proc/{pid}/task/{th.id}/comm") as f:
                                comm = f.read().strip()
                        except OSError:
                            continue
                        key = f"{pid}.{th.id}"
                        self._thread_labels[key] = f"{label} / thread {comm}"
                        out[key] = th.user_time + th.system_time
            except (psutil.Error, OSError):
                continue
        return out

    def _run(self) -> None:
        n, keys = 0, ()
        while not self._stop.is_set():
            if n % self.refresh_every == 0:
                self._refresh()
            n += 1
            t, busy, sample = time.time(), _machine_busy_s(), self._sample()
            if tuple(sample) != keys:
                keys = tuple(sample)
            self._samples.append((t, busy, keys, array("d", sample.values())))
            self._stop.wait(self.interval_s)

    def window(self, t0: float, t1: float) -> dict:
        """CPU use (cores) of each label from the last sample at or before `t0` to the first at or
        after `t1` (wall clock, time.time())."""
        samples = self._samples[:]  # the sampler may append meanwhile
        times = [s[0] for s in samples]
        i0 = max(bisect.bisect_right(times, t0) - 1, 0)
        i1 = min(bisect.bisect_left(times, t1), len(times) - 1)
        if i1 <= i0:
            return {"span_s": 0.0, "machine_busy_cores": None, "cores": {}}
        span = times[i1] - times[i0]
        (_, busy0, keys0, values0), (_, busy1, keys1, values1) = samples[i0], samples[i1]
        a, b = dict(zip(keys0, values0, strict=True)), dict(zip(keys1, values1, strict=True))
        cores: dict[str, float] = {}
        for key, cpu in b.items():
            if key in a:
                label = self._thread_labels.get(key) or self._labels.get(int(key), f"pid {key}")
                cores[label] = cores.get(label, 0.0) + (cpu - a[key]) / span
        return {"span_s": round(span, 3), "machine_busy_cores": round((busy1 - busy0) / span, 2), "cores": cores}

    @staticmethod
    def merge(windows: list[dict]) -> dict:
        """The time-weighted mean of several `window`s, labels under MIN_CORES left out, busiest first."""
        windows = [w for w in windows if w["span_s"] > 0]
        total = sum(w["span_s"] for w in windows)
        if not total:
            return {}
        cores: dict[str, float] = {}
        for w in windows:
            for label, c in w["cores"].items():
                cores[label] = cores.get(label, 0.0) + c * w["span_s"] / total
        busy = sum(w["machine_busy_cores"] * w["span_s"] for w in windows) / total
        kept = sorted(((c, label) for label, c in cores.items() if c >= MIN_CORES), reverse=True)
        return {
            "windows": len(windows),
            "span_s": round(total, 3),
            "machine_busy_cores": round(busy, 2),
            "cores": {label: round(c, 2) for c, label in kept},
        }
