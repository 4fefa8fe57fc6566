"""The plain prompt template of problem files (``data.prompt_template``: a string with ``{prompt}``),
how a prompt is rendered (``PromptStyle``), and the default answer marker (``data.answer_markers``).

Its own module, free of project imports and below both users, so that the job config
(``orchestrator.config``) checks a template with the same rule the file task
(``orchestrator.tasks.file_task``) renders it by, and the SFT warm-up (``trainer.sft_file``, which
may not import the orchestrator) renders its ``prompt`` records as the file task renders problems.
"""

from __future__ import annotations

import dataclasses
import logging
import string
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "{prompt}"  # the prompt as written
DEFAULT_ANSWER_MARKERS: tuple[str, ...] = ("####",)  # the demo's: "#### 933"


def template_error(template: Any) -> str | None:
    """Why ``template`` is not a plain prompt template (a string with ``{prompt}`` and no other field), or None."""
    if not isinstance(template, str):
        return f"expected a string with {{prompt}} in it, got {template!r}"
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return f"{template!r} is not a format string ({e}); write a literal brace as {{{{ or }}}}"
    other = sorted({f for f in fields if f != "prompt"})
    if other or "prompt" not in fields:
        return (
            f"{template!r} must contain {{prompt}} and no other field (found {other or 'no {prompt}'}); "
            "write a literal brace as {{ or }}"
        )
    return None


@dataclasses.dataclass(frozen=True)
class PromptStyle:
    """How the RL job renders a prompt: ``data.prompt_template`` with ``{prompt}`` filled in, as plain
    text (``chat_template`` False) or as one user turn handed to the model's chat template (True). The
    file task renders its problems' prompts by it, the SFT warm-up its ``prompt`` records. The
    default: as written, plain."""

    template: str = DEFAULT_TEMPLATE
    chat_template: bool = False
    system_prompt: str | None = None  # a system turn before every conversation (data.fields.system_prompt)

    def text(self, prompt: str) -> str:
        """The prompt with the template filled in (the whole prompt when ``chat_template`` is False)."""
        return self.template.format(prompt=prompt)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The conversation the chat template gets: one user turn (after the system turn, if any)."""
        return self.with_system([{"role": "user", "content": self.text(prompt)}])

    def with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the system turn first, unless there is none or they begin with their own."""
        if self.system_prompt is None or (messages and messages[0].get("role") == "system"):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]
