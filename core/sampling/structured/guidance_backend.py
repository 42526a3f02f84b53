"""The ``guidance`` structured-output backend (PyPI ``llguidance``): JSON schemas, regexes and Lark or
GBNF grammars parsed by an Earley parser over the tokenizer's token trie, masks computed lazily per step."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from pagoda.config import ModelConfig
from pagoda.errors import BackendUnavailable, InvalidRequestError
from pagoda.sampling.structured.spec import kind_of, param_of, schema_of
from pagoda.sampling_params import StructuredOutputsParams

# the JSON llguidance writes: ", " and ": " between items and nothing else, as the xgrammar backend
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceBackend:
    """Compiles to an ``llguidance.LLMatcher`` template; each sequence gets a copy of it."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, eos_token_ids: list[int]) -> None:
        try:
            import llguidance
            import llguidance.hf
            import llguidance.torch
        except ImportError:
            raise BackendUnavailable("the guidance structured-output backend needs the llguidance package: "
                                     "pip install llguidance") from None
        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model_config.vocab_size,
                                                      eos_token=list(eos_token_ids) or None)

    def supports(self, spec: StructuredOutputsParams) -> Optional[str]:
        return None

    def compile(self, spec: StructuredOutputsParams) -> Any:
        llg, kind = self._llg, kind_of(spec)
        try:
            if kind in ("json", "json_object"):
                grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema_of(spec)),
                                                                 overrides=_JSON_OPTIONS)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", json.dumps(list(spec.choice)))
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
            else:
                grammar = llg.grammar_from("grammar", spec.grammar)
            template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            error = template.get_error() if template.is_error() else ""
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError and RuntimeError for bad input
            error = str(exc).strip() or type(exc).__name__
        if error:
            raise InvalidRequestError(f"{param_of(spec)} does not compile with llguidance: {error}",
                                      param=param_of(spec))
        return template

    def new_matcher(self, compiled: Any) -> "GuidanceMatcher":
        return GuidanceMatcher(compiled.deep_copy(), self._llg.torch.fill_next_token_bitmask)


class GuidanceMatcher:
    """One sequence's ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any, fill: Any) -> None:
        self.matcher = matcher
        self._fill = fill

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self.matcher, bitmask, row)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self.matcher.validate_tokens(token_ids) < len(token_ids):
            return False
        return self.matcher.consume_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        # stopped: complete, and nothing but an end-of-sequence token may follow
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def may_end(self) -> bool:
        return self.matcher.is_accepting()

    def fork(self) -> "GuidanceMatcher":
        return GuidanceMatcher(self.matcher.deep_copy(), self._fill)
