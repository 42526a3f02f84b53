"""Reasoning effort: ``reasoning_effort`` on chat completions and ``reasoning.effort`` on ``/v1/responses``.

The effort reaches the chat template as variables, as vLLM passes it: ``reasoning_effort`` itself (gpt-oss's
template writes it into the harmony system message, ``Reasoning: low``), and ``enable_thinking``, false for
``none`` and true otherwise (the thinking switch of Qwen3's and other templates). A variable the request's
``chat_template_kwargs`` sets itself is left as it is. A template that reads neither variable renders the same
prompt whatever the effort: the field is then accepted and named in the ignored-fields header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pagoda.plugins.entrypoints.server.errors import APIError

# the values vLLM's request schemas accept (OpenAI's, and "max" of some templates)
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# the levels of gpt-oss's harmony format (its system message's "Reasoning: ..." line)
HARMONY_EFFORTS = ("low", "medium", "high")
_READ_BY_TEMPLATE = re.compile(r"\b(reasoning_effort|enable_thinking)\b")


@dataclass(frozen=True)
class EffortOptions:
    """What a server's model does with a request's reasoning effort."""

    is_read: bool = False  # the chat template reads reasoning_effort or enable_thinking
    levels: Optional[tuple[str, ...]] = None  # the efforts the model knows (None: any the schema takes)
    family: str = ""  # the format that knows only ``levels``, for the 400's message

    @classmethod
    def resolve(cls, hf_config: dict[str, Any], template: Optional[str]) -> "EffortOptions":
        is_read = bool(template) and _READ_BY_TEMPLATE.search(template) is not None
        if hf_config.get("model_type") == "gpt_oss":
            return cls(is_read, HARMONY_EFFORTS, "gpt-oss's harmony format")
        return cls(is_read)

    @classmethod
    def for_engine(cls, engine: Any) -> "EffortOptions":
        """:meth:`resolve` for a built engine: its checkpoint's config and its tokenizer's template."""
        template = engine.tokenizer.chat_template
        if isinstance(template, dict):
            template = "\n".join(template.values())
        return cls.resolve(engine.config.model.hf_config, template)

    def template_kwargs(self, effort: Optional[str], kwargs: dict, param: str) -> dict:
        """The template variables of a request: its ``chat_template_kwargs`` (``kwargs``) plus what its effort
        (the field ``param``) sets; a 400 naming the field for an effort the model does not know."""
        chosen = kwargs.get("reasoning_effort", effort)
        if chosen is not None and self.levels is not None and chosen not in self.levels:
            field = "chat_template_kwargs" if "reasoning_effort" in kwargs else param
            raise APIError(400, f"{field}: {chosen!r} is not a reasoning effort {self.family} knows; send one of "
                                f"{', '.join(repr(e) for e in self.levels)}", param=field)
        if effort is None:
            return kwargs
        extra = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        return {**extra, **kwargs}
