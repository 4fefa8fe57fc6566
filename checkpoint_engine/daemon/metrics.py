"""The daemon's `GET /metrics`: Prometheus text exposition (format 0.0.4), written by hand (no client
library needed: the daemon's `[server]` extra stays small).

    routes ──observe_request(route, method, status)──▶ DaemonMetrics ──render(records)──▶ text/plain
    Driver.run results ──observe_command(cmd, result, seconds)──▶   (one instance per app: no globals)
    GET /metrics: the engine board's records (states, restarts, recovery) read at scrape time

Every name starts with `checkpoint_engine_`; docs/daemon.md lists them all. Thread-safe: commands end
on executor threads (and the healer's thread), scrapes run on the event loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable

from checkpoint_engine.engines.states import STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "checkpoint_engine_"
# UpdateMetrics' stage timings (seconds) as the label `stage` of the last update's gauge
STAGES = ("open", "setup", "copy_in", "broadcast", "engine_wait", "agree", "finish", "close")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    """One metric family: its type, help and samples keyed by their label values."""

    def __init__(self, name: str, kind: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.kind, self.help, self.labels = PREFIX + name, kind, help_text, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, by: float = 1.0) -> None:
        key = tuple(str(v) for v in label_values)
        self.values[key] = self.values.get(key, 0) + by

    def set(self, value: float, *label_values: str) -> None:
        self.values[tuple(str(v) for v in label_values)] = value

    def lines(self, values: dict[tuple[str, ...], float] | None = None) -> list[str]:
        out = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for key, value in sorted((self.values if values is None else values).items()):
            out.append(f"{self.name}{self._labels(key)} {_number(value)}")
        return out

    def _labels(self, key: tuple[str, ...]) -> str:
        if not key:
            return ""
        return "{" + ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(self.labels, key)) + "}"


class _Summary:
    """A summary without quantiles: `_count` and `_sum` of observed seconds."""

    def __init__(self, name: str, help_text: str):
        self.name, self.help = PREFIX + name, help_text
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value

    def lines(self) -> list[str]:
        return [
            f"# HELP {self.name} {_escape_help(self.help)}",
            f"# TYPE {self.name} summary",
            f"{self.name}_count {self.count}",
            f"{self.name}_sum {_number(self.sum)}",
        ]


class DaemonMetrics:
    """Counters and gauges of one daemon (one per `make_app`); `render` writes the exposition text."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self.requests = _Family(
            "http_requests_total",
            "counter",
            "HTTP requests answered, by route template, method and status code",
            ("route", "method", "status"),
        )
        self.commands = _Family(
            "commands_total",
            "counter",
            "commands relayed to every rank (HTTP routes and the healer), by operation and outcome",
            ("op", "outcome"),
        )
        self.failures = _Family(
            "failures_total",
            "counter",
            "failed commands by operation and failure kind (each kind its failing ranks reported, once per command)",
            ("op", "kind"),
        )
        self.updates = _Family("updates_total", "counter", "weight updates (op update), by outcome", ("outcome",))
        self.update_bytes = _Family(
            "update_bytes_total", "counter", "bytes of the checkpoints successful updates delivered (once per update)"
        )
        self.update_seconds = _Summary("update_duration_seconds", "seconds of successful updates (slowest rank)")
        self.last_stage = _Family(
            "last_update_stage_seconds",
            "gauge",
            "the last successful update's seconds per stage, on its slowest rank",
            ("stage",),
        )
        self.last_total = _Family("last_update_seconds", "gauge", "the last successful update's total seconds")
        self.last_rate = _Family("last_update_gib_per_second", "gauge", "the last successful update's GiB/s")
        self.last_bytes = _Family("last_update_bytes", "gauge", "the last successful update's bytes")
        self.last_time = _Family(
            "last_update_timestamp_seconds", "gauge", "Unix time at which the last successful update ended"
        )
        self.heals = _Family(
            "heals_total",
            "counter",
            "engine heals (restart + update to the current checkpoint), by outcome",
            ("outcome",),
        )
        self.heal_seconds = _Summary("heal_duration_seconds", "seconds of each heal command (restart and update)")
        self.world = _Family("world_size", "gauge", "the daemon's ranks")
        self.world.set(world_size)
        self.last_total.set(0.0)
        self.last_rate.set(0.0)
        self.last_bytes.set(0)
        self.last_time.set(0)
        for stage in STAGES:
            self.last_stage.set(0.0, stage)
        self.update_bytes.set(0)
        for outcome in ("ok", "error"):
            self.updates.set(0, outcome)
            self.heals.set(0, outcome)

    # -- fed by the routes and the driver ----------------------------------------------------------
    def observe_request(self, route: str, method: str, status: int) -> None:
        with self._lock:
            self.requests.inc(route, method, str(status))

    def observe_command(self, cmd: dict, result: dict, seconds: float) -> None:
        """One relayed command's result (`Driver.run`'s answer)."""
        op = str(cmd.get("op"))
        ok = bool(result.get("ok"))
        outcome = "ok" if ok else "error"
        ranks = [r for r in result.get("ranks") or [] if isinstance(r, dict)]
        with self._lock:
            self.commands.inc(op, outcome)
            if not ok:
                kinds = {str(r["kind"]) for r in ranks if not r.get("ok") and r.get("kind")}
                kinds = kinds or {str(result.get("kind") or "unknown")}
                for kind in sorted(kinds):
                    self.failures.inc(op, kind)
            if cmd.get("heal"):
                self.heals.inc(outcome)
                self.heal_seconds.observe(seconds)
            if op == "update":
                self.updates.inc(outcome)
                if ok:
                    self._last_update([r.get("result") for r in ranks])

    def _last_update(self, results: Iterable) -> None:
        metrics = [m for m in results if isinstance(m, dict) and "total_s" in m]
        if not metrics:
            return
        slowest = max(metrics, key=lambda m: m.get("total_s") or 0.0)
        total_bytes = max(int(m.get("total_bytes") or 0) for m in metrics)
        self.update_bytes.inc(by=total_bytes)
        self.update_seconds.observe(float(slowest.get("total_s") or 0.0))
        for stage in STAGES:
            self.last_stage.set(float(slowest.get(f"{stage}_s") or 0.0), stage)
        self.last_total.set(float(slowest.get("total_s") or 0.0))
        self.last_rate.set(float(slowest.get("gib_per_s") or 0.0))
        self.last_bytes.set(total_bytes)
        self.last_time.set(round(time.time(), 3))

    # -- the exposition ------------------------------------------------------------------------------
    def render(self, engine_records: list[dict] | None = None) -> str:
        """The text of `GET /metrics`; `engine_records`: the engine board's (None: no managed engines)."""
        with self._lock:
            lines: list[str] = []
            for family in (
                self.world,
                self.requests,
                self.commands,
                self.failures,
                self.updates,
                self.update_bytes,
            ):
                lines += family.lines()
            lines += self.update_seconds.lines()
            for family in (self.last_stage, self.last_total, self.last_rate, self.last_bytes, self.last_time):
                lines += family.lines()
            lines += self.heals.lines()
            lines += self.heal_seconds.lines()
        if engine_records is not None:
            lines += _engine_lines(engine_records)
        return "\n".join(lines) + "\n"


def _engine_lines(records: list[dict]) -> list[str]:
    state = _Family(
        "engine_state", "gauge", "1 for the state each rank's managed engine is in, 0 for the others", ("rank", "state")
    )
    restarts = _Family("engine_restarts", "gauge", "restarts (heals) of each rank's managed engine", ("rank",))
    recovery = _Family(
        "engine_recovery_seconds", "gauge", "seconds from failure to serving of each engine's last heal", ("rank",)
    )
    for rec in records:
        rank = str(rec.get("rank"))
        for s in STATES:
            state.set(1 if rec.get("state") == s else 0, rank, s)
        restarts.set(int(rec.get("restarts") or 0), rank)
        if rec.get("recovery_s") is not None:
            recovery.set(float(rec["recovery_s"]), rank)
    return state.lines() + restarts.lines() + recovery.lines()


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
