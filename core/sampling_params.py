"""Per-request sampling parameters, named as vLLM names them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagoda.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed")
_OPTIONAL_FIELDS = {"max_tokens", "logprobs", "prompt_logprobs", "seed"}
MAX_LOGPROBS = 20  # the default of --max-logprobs (OpenAI's limit, and vLLM's default)
MAX_TOP_K = 2 ** 31 - 1  # ranks are compared in 32-bit tensors; a top_k at or above the vocabulary keeps all


@dataclass
class StructuredOutputsParams:
    """What the output must match, exactly one of: ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF/Lark).
    ``backend`` names a structured-output backend for this request (None: the engine's choice).
    ``reasoning_parser`` names a ``pagoda_reasoning_parsers`` parser: the constraint then holds the answer after
    the thinking that parser finds in the generated ids, starting where the thinking ends (None: the whole
    output, from its first token; docs/reasoning.md)."""

    json: Union[None, str, dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    backend: Optional[str] = None
    reasoning_parser: Optional[str] = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or grammar; got "
                + (", ".join(given) if given else "none"), param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object or its JSON text)",
                                      param="structured_outputs.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string",
                                          param=f"structured_outputs.{name}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      param="structured_outputs.choice")


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature=0`` is greedy. ``max_tokens=None`` means "until the context
    is full"; ``max_tokens=0`` only computes the prompt (its KV and, with
    ``prompt_logprobs``, its logprobs) and ends with finish reason ``length``
    and no token. Invalid values raise :class:`pagoda.errors.InvalidRequestError`
    at construction, naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    detokenize: bool = True
    # what the output must match (a JSON schema, regex, choice, grammar); None: free text
    structured_outputs: Optional[StructuredOutputsParams] = None
    # the only tokens that may be drawn (None: any)
    allowed_token_ids: Optional[list[int]] = None
    # words that must not appear in the output: a word's last token is banned where its earlier tokens end
    # the output (each word as the tokenizer writes it alone and after a space)
    bad_words: Optional[list[str]] = None
    # keep only the last N prompt tokens (-1: the last max_model_len - 1); None: the whole prompt
    truncate_prompt_tokens: Optional[int] = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise InvalidRequestError(f"stop={self.stop!r} is invalid: must be a string or a list of strings",
                                      param="stop")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, expected: str) -> None:
            raise InvalidRequestError(f"{name}={getattr(self, name)!r} is invalid: {expected}", param=name)

        # types first, so the range checks below compare numbers (bool is an int in Python, but not here)
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
                bad(name, "must be a number")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                bad(name, "must be an integer" + (" or None" if name in _OPTIONAL_FIELDS else ""))

        if self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be in [0, {MAX_TOP_K}] (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2]")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", "must be >= 0 (0 computes the prompt only, e.g. for its prompt_logprobs)")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        # the upper bound is the engine's --max-logprobs (RequestLimits.check)
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    bad("logit_bias", "keys must be non-negative token ids")
                if not -100 <= bias <= 100:
                    bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                  for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0):
            bad("truncate_prompt_tokens", "must be a positive number of tokens, or -1 for as many as the context "
                                          "holds")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a pagoda.sampling_params.StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s settings, as vLLM's: keep the ``beam_width`` continuations of highest score, each
    step extending every beam by its ``2 * beam_width`` most likely tokens, for at most ``max_tokens`` tokens. A
    beam's score is its cumulative logprob over ``len(tokens) ** length_penalty`` (tokens: the prompt's and its
    own, its end-of-sequence token not counted). A beam that draws the end-of-sequence token ends there, unless
    ``ignore_eos``. ``temperature`` scales the logits the logprobs come from (0: as they are)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        from pagoda.errors import InvalidRequestError

        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width={self.beam_width!r}: give a whole number >= 1", param="beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r}: give a whole number >= 1", param="max_tokens")
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature={self.temperature!r}: give a number >= 0", param="temperature")
