"""Errors that callers of the checkpoint engine catch.

Every one is a `RuntimeError`, as in MoonshotAI's checkpoint-engine, whose callers catch
`RuntimeError` around `update`. `UpdateFailed` keeps MoonshotAI's wording ("Failed to update
weights due to remote errors") and adds which rank failed and why.
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


class HTTPError(CheckpointEngineError):
    """An HTTP server answered with a status >= 400 (`checkpoint_engine.httpjson`'s client).

    `status` is the HTTP status code and `text` the answer's body, so callers branch on the code.
    """

    def __init__(self, method: str, url: str, status: int, text: str):
        self.method, self.url, self.status, self.text = method, url, status, text
        super().__init__(f"{method} {url} answered HTTP {status}: {text[:2000]}")
