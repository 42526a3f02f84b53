"""Reasoning outputs on ``/v1/chat/completions``: which parser sets a model's thinking apart from its answer, and
what that means for one request.

The parser is ``--reasoning-parser NAME``'s, or the model family's where it is unambiguous (Qwen3's
``model_type``, gpt-oss's, a chat template that writes ``</think>`` as DeepSeek-R1's distillations do). Each
answer is read by a new parser made for its prompt: its thinking goes out as ``reasoning_content`` (in the
stream as ``delta.reasoning_content``), its answer as ``content``, which the tool-call parser then reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.reasoning import ReasoningDelta
from pagoda.sampling_params import SamplingParams

REASONING_PARSERS_HOOK = "pagoda_reasoning_parsers"

# model_type -> the reasoning parser of the family (vLLM's names)
FAMILY_REASONING_PARSERS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "openai_gptoss"}


def family_reasoning_parser(hf_config: dict, chat_template: str) -> tuple[Optional[str], str]:
    """The family's reasoning parser (None: none is known) and why."""
    text_config = hf_config.get("text_config", hf_config)
    model_type = str(text_config.get("model_type") or hf_config.get("model_type") or "")
    if model_type in FAMILY_REASONING_PARSERS:
        return FAMILY_REASONING_PARSERS[model_type], f"model_type {model_type!r}"
    if "</think>" in chat_template:
        return "deepseek_r1", "its chat template writes </think>, as DeepSeek-R1's do"
    return None, f"no reasoning format is known for model_type {model_type!r}"


@dataclass(frozen=True)
class ReasoningOptions:
    """The server's reasoning parser (``name`` None: answers are all content) and how it was chosen."""

    name: Optional[str] = None
    factory: Any = None  # a pagoda.interfaces.ReasoningParserFactory
    reason: str = ""

    @classmethod
    def resolve(cls, plugin_manager: Any, reasoning_parser: Optional[str] = None, hf_config: Optional[dict] = None,
                chat_template: Optional[str] = None) -> "ReasoningOptions":
        """The parser named by ``--reasoning-parser`` (``none``: off), or the family's of the checkpoint
        (``hf_config`` None: not known yet, only the flag is checked). An unknown name is a ConfigError listing
        the installed parsers."""
        if reasoning_parser == "none":
            return cls(reason="--reasoning-parser none")
        if reasoning_parser is not None:
            factory = plugin_manager.get(REASONING_PARSERS_HOOK, reasoning_parser, "--reasoning-parser").factory
            return cls(reasoning_parser, factory, "named by --reasoning-parser")
        if hf_config is None:
            return cls()
        name, reason = family_reasoning_parser(hf_config, chat_template or "")
        if name is None:
            return cls(reason=reason)
        if name not in plugin_manager.names(REASONING_PARSERS_HOOK):
            return cls(reason=f"its family's reasoning parser {name!r} is not installed")
        return cls(name, plugin_manager.get(REASONING_PARSERS_HOOK, name, "--reasoning-parser").factory, reason)

    @classmethod
    def for_engine(cls, engine: Any, reasoning_parser: Optional[str] = None) -> "ReasoningOptions":
        """:meth:`resolve` for a built engine: its checkpoint's config and its tokenizer's template."""
        template = engine.tokenizer.chat_template
        if isinstance(template, dict):
            template = "\n".join(template.values())
        return cls.resolve(engine.pm, reasoning_parser, engine.config.model.hf_config, template)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.name is None:
            return (f"reasoning: answers are all content ({self.reason or 'no reasoning parser'}); name a parser "
                    "with --reasoning-parser NAME")
        return (f"reasoning: thinking read by the {self.name!r} reasoning parser into reasoning_content ({self.reason}); "
                "override with --reasoning-parser NAME, turn off with --reasoning-parser none")

    def plan(self, prompt: str) -> "ReasoningRequest":
        """How one request's answers are read, given its rendered prompt."""
        if self.factory is None:
            return ReasoningRequest(None, prompt)
        return ReasoningRequest(self.factory, prompt, self.name)


@dataclass(frozen=True)
class ReasoningRequest:
    """One request's reasoning: a new parser per answer (``factory`` None: none)."""

    factory: Any
    prompt: str
    name: Optional[str] = None  # the parser's name (the engine starts a constraint where it finds the thinking's end)

    @property
    def is_on(self) -> bool:
        return self.factory is not None

    def new_parser(self) -> Any:
        return None if self.factory is None else self.factory(self.prompt)

    @property
    def may_think(self) -> bool:
        """Whether answers may begin with thinking (False: the prompt switched thinking off, or no parser)."""
        parser = self.new_parser()
        return parser is not None and getattr(parser, "may_think", True)

    def adjust(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the special tokens kept when the parser reads markers that are special tokens, and
        their constraint (structured outputs, a forced tool choice) started where the thinking ends."""
        parser = self.new_parser()
        if parser is None:
            return params
        if not parser.skip_special_tokens and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        if params.structured_outputs is not None and self.may_think:
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, reasoning_parser=self.name))
        return params

    def read(self, text: str) -> ReasoningDelta:
        """A whole answer -> its thinking and its answer."""
        parser = self.new_parser()
        return ReasoningDelta("", text) if parser is None else parser.extract_reasoning(text)


class StreamedReasoning:
    """One streamed answer's reasoning reader."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser

    def delta(self, text: str, is_last: bool) -> ReasoningDelta:
        if self.parser is None:
            return ReasoningDelta("", text)
        delta = self.parser.extract_reasoning_streaming(text)
        return delta + self.parser.finish_streaming() if is_last else delta

