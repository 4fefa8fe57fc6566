"""Errors that callers of the checkpoint engine catch.

Every one is a `RuntimeError`, as in MoonshotAI's checkpoint-engine, whose callers catch
`RuntimeError` around `update`. `UpdateFailed` keeps MoonshotAI's wording ("Failed to update
weights due to remote errors") and adds which rank failed and why. `CheckpointNotFound` and
`CheckpointExists` are also `ValueError`s (what they were before they had types); the daemon maps
them, `DaemonBusy` and `DaemonUnavailable` to its HTTP statuses (`daemon_commands.KIND_STATUS`).
"""

from __future__ import annotations

REMOTE_ERRORS = "Failed to update weights due to remote errors"


class CheckpointEngineError(RuntimeError):
    """Base of the errors the checkpoint engine raises at run time."""


class UpdateFailed(CheckpointEngineError):
    """An update was aborted on every live rank; `failures` maps each failing rank to its cause."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        super().__init__(f"{REMOTE_ERRORS}: weight update aborted on all ranks ({detail})")


class CheckpointNotFound(CheckpointEngineError, ValueError):
    """The named checkpoint is not registered (here, or on any rank): the daemon answers HTTP 404.

    Also a `ValueError`, which these failures were before they had a type of their own."""


class CheckpointExists(CheckpointEngineError, ValueError):
    """The name is registered already: the daemon answers HTTP 409. Also a `ValueError`."""


class DaemonBusy(CheckpointEngineError):
    """The daemon runs another command: this one was refused at once, not queued (HTTP 409)."""


class DaemonUnavailable(CheckpointEngineError):
    """The daemon cannot run commands: a rank died or stayed silent past its deadline (a collective
    that timed out cannot be aborted, so the daemon must be restarted), or it is stopping (HTTP 503)."""
