"""The daemon's `GET /metrics`: Prometheus text exposition, written by `prometheus_client`.

    routes ──observe_request(route, method, status)──▶ DaemonMetrics ──render(records)──▶ text/plain
    Driver.run results ──observe_command(cmd, result, seconds)──▶   (one registry per app: no globals)
    GET /metrics: the engine board's records (states, restarts, recovery) read at scrape time

`DaemonMetrics` keeps its numbers itself and is the collector of its own `CollectorRegistry`: each
scrape turns them into metric families (`FAMILIES`), which `generate_latest` writes. prometheus_client's
Counter and Summary would add a `_created` series to each family; the families here carry exactly the
samples docs/daemon.md lists. Every name starts with `checkpoint_engine_`. Thread-safe: commands end
on executor threads (and the healer's thread), scrapes run on the event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from checkpoint_engine.engines.states import STATES

# what `generate_latest` writes (the text format, version 0.0.4): prometheus_client's own answer to a
# scraper that asks for nothing else
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFIX = "checkpoint_engine_"
# UpdateMetrics' stage timings (seconds) as the label `stage` of the last update's gauge
STAGES = ("open", "setup", "copy_in", "broadcast", "engine_wait", "agree", "finish", "close")

# name (after PREFIX; a counter's without `_total`): type, help, label names, in the order of /metrics
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "world_size": ("gauge", "the daemon's ranks", ()),
    "http_requests": (
        "counter",
        "HTTP requests answered, by route template, method and status code",
        ("route", "method", "status"),
    ),
    "commands": (
        "counter",
        "commands relayed to every rank (HTTP routes and the healer), by operation and outcome",
        ("op", "outcome"),
    ),
    "failures": (
        "counter",
        "failed commands by operation and failure kind (each kind its failing ranks reported, once per command)",
        ("op", "kind"),
    ),
    "updates": ("counter", "weight updates (op update), by outcome", ("outcome",)),
    "update_bytes": ("counter", "bytes of the checkpoints successful updates delivered (once per update)", ()),
    "update_duration_seconds": ("summary", "seconds of successful updates (slowest rank)", ()),
    "last_update_stage_seconds": (
        "gauge",
        "the last successful update's seconds per stage, on its slowest rank",
        ("stage",),
    ),
    "last_update_seconds": ("gauge", "the last successful update's total seconds", ()),
    "last_update_gib_per_second": ("gauge", "the last successful update's GiB/s", ()),
    "last_update_bytes": ("gauge", "the last successful update's bytes", ()),
    "last_update_timestamp_seconds": ("gauge", "Unix time at which the last successful update ended", ()),
    "heals": ("counter", "engine heals (restart + update to the current checkpoint), by outcome", ("outcome",)),
    "heal_duration_seconds": ("summary", "seconds of each heal command (restart and update)", ()),
}
# read from the engine board at each scrape (only when the daemon manages engines)
ENGINE_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "engine_state": (
        "gauge",
        "1 for the state each rank's managed engine is in, 0 for the others",
        ("rank", "state"),
    ),
    "engine_restarts": ("gauge", "restarts (heals) of each rank's managed engine", ("rank",)),
    "engine_recovery_seconds": ("gauge", "seconds from failure to serving of each engine's last heal", ("rank",)),
}
_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "summary": SummaryMetricFamily}


def _family(name: str, spec: tuple[str, str, tuple[str, ...]], values: dict) -> Metric:
    """One family's samples: `values` maps label values to the value (a summary's: to [count, sum])."""
    kind, help_text, labels = spec
    family = _KINDS[kind](PREFIX + name, help_text, labels=labels)
    for key, value in sorted(values.items()):
        if kind == "summary":
            family.add_metric(list(key), count_value=value[0], sum_value=value[1])
        else:
            family.add_metric(list(key), value)
    return family


class DaemonMetrics:
    """Counters and gauges of one daemon (one per `make_app`), exposed through `registry`; `render`
    writes the exposition text."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self._scrape_lock = threading.Lock()  # one scrape at a time sees `_engine_records`
        self._values: dict[str, dict] = {name: {} for name in FAMILIES}
        self._engine_records: list[dict] | None = None  # the board's, during one scrape
        self._set("world_size", world_size)
        for name in ("last_update_seconds", "last_update_gib_per_second", "last_update_bytes", "update_bytes"):
            self._set(name, 0)
        self._set("last_update_timestamp_seconds", 0)
        for stage in STAGES:
            self._set("last_update_stage_seconds", 0, stage)
        for outcome in ("ok", "error"):
            self._set("updates", 0, outcome)
            self._set("heals", 0, outcome)
        for name in ("update_duration_seconds", "heal_duration_seconds"):
            self._values[name][()] = [0, 0.0]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _set(self, name: str, value: float, *labels: str) -> None:
        self._values[name][labels] = value

    def _inc(self, name: str, *labels: str, by: float = 1) -> None:
        values = self._values[name]
        values[labels] = values.get(labels, 0) + by

    def _observe(self, name: str, seconds: float) -> None:
        summary = self._values[name][()]
        summary[0] += 1
        summary[1] += seconds

    # -- fed by the routes and the driver ----------------------------------------------------------
    def observe_request(self, route: str, method: str, status: int) -> None:
        with self._lock:
            self._inc("http_requests", str(route), str(method), str(status))

    def observe_command(self, cmd: dict, result: dict, seconds: float) -> None:
        """One relayed command's result (`Driver.run`'s answer)."""
        op = str(cmd.get("op"))
        ok = bool(result.get("ok"))
        outcome = "ok" if ok else "error"
        ranks = [r for r in result.get("ranks") or [] if isinstance(r, dict)]
        with self._lock:
            self._inc("commands", op, outcome)
            if not ok:
                kinds = {str(r["kind"]) for r in ranks if not r.get("ok") and r.get("kind")}
                kinds = kinds or {str(result.get("kind") or "unknown")}
                for kind in sorted(kinds):
                    self._inc("failures", op, kind)
            if cmd.get("heal"):
                self._inc("heals", outcome)
                self._observe("heal_duration_seconds", seconds)
            if op == "update":
                self._inc("updates", outcome)
                if ok:
                    self._last_update([r.get("result") for r in ranks])

    def _last_update(self, results: Iterable) -> None:
        metrics = [m for m in results if isinstance(m, dict) and "total_s" in m]
        if not metrics:
            return
        slowest = max(metrics, key=lambda m: m.get("total_s") or 0.0)
        total_bytes = max(int(m.get("total_bytes") or 0) for m in metrics)
        self._inc("update_bytes", by=total_bytes)
        self._observe("update_duration_seconds", float(slowest.get("total_s") or 0.0))
        for stage in STAGES:
            self._set("last_update_stage_seconds", float(slowest.get(f"{stage}_s") or 0.0), stage)
        self._set("last_update_seconds", float(slowest.get("total_s") or 0.0))
        self._set("last_update_gib_per_second", float(slowest.get("gib_per_s") or 0.0))
        self._set("last_update_bytes", total_bytes)
        self._set("last_update_timestamp_seconds", round(time.time(), 3))

    # -- the exposition ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """The families of one scrape (prometheus_client's collector interface)."""
        with self._lock:
            families = [_family(name, spec, self._values[name]) for name, spec in FAMILIES.items()]
        yield from families
        if self._engine_records is not None:
            yield from _engine_families(self._engine_records)

    def render(self, engine_records: list[dict] | None = None) -> str:
        """The text of `GET /metrics`; `engine_records`: the engine board's (None: no managed engines)."""
        with self._scrape_lock:
            self._engine_records = engine_records
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._engine_records = None


def _engine_families(records: list[dict]) -> list[Metric]:
    values: dict[str, dict] = {name: {} for name in ENGINE_FAMILIES}
    for rec in records:
        rank = str(rec.get("rank"))
        for s in STATES:
            values["engine_state"][(rank, s)] = 1 if rec.get("state") == s else 0
        values["engine_restarts"][(rank,)] = int(rec.get("restarts") or 0)
        if rec.get("recovery_s") is not None:
            values["engine_recovery_seconds"][(rank,)] = float(rec["recovery_s"])
    return [_family(name, spec, values[name]) for name, spec in ENGINE_FAMILIES.items()]


class ObservedDriver:
    """A Driver whose every `run` is observed by `metrics` (the healer's commands reach the metrics too);
    every other attribute is the driver's own."""

    def __init__(self, driver, metrics: DaemonMetrics):
        self._driver, self._metrics = driver, metrics

    def run(self, cmd: dict, *args, **kwargs) -> dict:
        t0 = time.perf_counter()
        result = self._driver.run(cmd, *args, **kwargs)
        self._metrics.observe_command(cmd, result, time.perf_counter() - t0)
        return result

    def __getattr__(self, name: str):
        return getattr(self._driver, name)
