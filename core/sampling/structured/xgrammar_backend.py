"""The ``xgrammar`` structured-output backend (PyPI ``xgrammar``): JSON schemas, regexes, EBNF and Lark
grammars compiled to a token-level pushdown automaton; masks are filled from its precomputed token tables."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Optional

import torch

from pagoda.config import ModelConfig
from pagoda.errors import BackendUnavailable, InvalidRequestError
from pagoda.sampling.structured.compile_process import CompileProcesses, CompileProcessFailed
from pagoda.sampling.structured.spec import is_ebnf, kind_of, param_of, schema_of
from pagoda.sampling_params import StructuredOutputsParams


# what xgrammar drops from a string schema that has a format
_FORMAT_OVERRIDES = ("minLength", "maxLength", "pattern")
# compile processes: the engine runs two compiles at once
NUM_COMPILE_PROCESSES = 2
# a calendar date that exists (years 0001-9999, each month's days, 29 February in leap years only): xgrammar's
# own "date" format lets any day 01-31 through, so a sampled "2023-02-30" broke the schema's format
_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(?:\d{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
CALENDAR_DATE = (rf"^(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
                 rf"|02-(?:0[1-9]|1\d|2[0-8]))|{_LEAP_YEAR}-02-29)$")


def _subschemas(node: Any) -> Iterator[dict]:
    """Every dict inside a schema (the subschemas among them), depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _subschemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _subschemas(value)


class XgrammarBackend:
    """Compiles with one ``xgrammar.GrammarCompiler`` for the model's tokenizer (pagoda keeps the cache)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, eos_token_ids: list[int]) -> None:
        try:
            import xgrammar
        except ImportError:
            raise BackendUnavailable("the xgrammar structured-output backend needs the xgrammar package: "
                                     "pip install xgrammar") from None
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.vocab_size,
                                                       stop_token_ids=list(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.processes = CompileProcesses(info, NUM_COMPILE_PROCESSES)

    def supports(self, spec: StructuredOutputsParams) -> Optional[str]:
        if spec.json is None:
            return None
        for node in _subschemas(schema_of(spec)):
            if "format" in node and any(k in node for k in _FORMAT_OVERRIDES):
                keys = ", ".join(k for k in _FORMAT_OVERRIDES if k in node)
                return (f"xgrammar applies a string's format ({node['format']!r}) and ignores its {keys}, so the "
                        "output could break the schema")
        return None

    def compile(self, spec: StructuredOutputsParams) -> Any:
        method, args, kwargs = self._call_of(spec)
        try:
            return getattr(self.compiler, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types for bad input
            raise self._refusal(spec, exc) from None

    def compile_until(self, spec: StructuredOutputsParams, should_stop: Callable[[float], bool]) -> Any:
        """:meth:`compile` in a worker process, killed (CompileStopped) once ``should_stop(seconds spent
        compiling)`` is true."""
        method, args, kwargs = self._call_of(spec)
        try:
            return self.processes.compile(method, args, kwargs, should_stop)
        except CompileProcessFailed:
            raise  # the server's failure, not the request's
        except RuntimeError as exc:
            raise self._refusal(spec, exc) from None

    def shutdown(self) -> None:
        self.processes.shutdown()

    @staticmethod
    def _with_calendar_dates(schema: Any) -> Any:
        """``schema`` with each string of format "date" held to :data:`CALENDAR_DATE` (a copy where changed)."""
        if isinstance(schema, list):
            return [XgrammarBackend._with_calendar_dates(v) for v in schema]
        if not isinstance(schema, dict):
            return schema
        out = {k: XgrammarBackend._with_calendar_dates(v) for k, v in schema.items()}
        if out.get("format") == "date" and not any(k in out for k in _FORMAT_OVERRIDES):
            del out["format"]
            out["pattern"] = CALENDAR_DATE
        return out

    @staticmethod
    def _with_escaped_control_characters(schema: Any) -> Any:
        """``schema`` with each length-bounded string (``minLength`` / ``maxLength``, no pattern, format, enum or
        const) held to a pattern of as many characters, none of them a control character (a copy where
        changed). xgrammar writes such a string as characters other than a quote, a backslash, CR or LF, which
        lets a raw control character through (a tab, or U+0017: a random model sampled one), and JSON allows them
        only escaped (RFC 8259; Python's ``json.loads`` refuses the answer); its unbounded strings exclude them."""
        if isinstance(schema, list):
            return [XgrammarBackend._with_escaped_control_characters(v) for v in schema]
        if not isinstance(schema, dict):
            return schema
        out = {k: XgrammarBackend._with_escaped_control_characters(v) for k, v in schema.items()}
        bounded = "minLength" in out or "maxLength" in out
        if (out.get("type") == "string" and bounded and not any(k in out for k in ("pattern", "format", "enum", "const"))
                and all(isinstance(out.get(k, 0), int) for k in ("minLength", "maxLength"))):
            low, high = out.pop("minLength", 0), out.pop("maxLength", None)
            out["pattern"] = "^[^\\x00-\\x1f]{%d,%s}$" % (low, "" if high is None else high)
        return out

    @staticmethod
    def _call_of(spec: StructuredOutputsParams) -> tuple[str, tuple, dict]:
        """The GrammarCompiler method and arguments that compile ``spec``."""
        kind = kind_of(spec)
        if kind in ("json", "json_object"):
            # one space after ',' and ':' and none elsewhere: a model cannot loop on whitespace
            schema = XgrammarBackend._with_escaped_control_characters(
                XgrammarBackend._with_calendar_dates(schema_of(spec)))
            return "compile_json_schema", (json.dumps(schema),), {"any_whitespace": False,
                                                                             "strict_mode": kind == "json"}
        if kind == "regex":
            return "compile_regex", (spec.regex,), {}
        if kind == "choice":
            return "compile_grammar", ("root ::= " + " | ".join(json.dumps(c) for c in spec.choice),), {}
        if is_ebnf(spec.grammar):
            return "compile_grammar", (spec.grammar,), {}
        return "compile_lark", (spec.grammar,), {}

    @staticmethod
    def _refusal(spec: StructuredOutputsParams, exc: Exception) -> InvalidRequestError:
        if isinstance(exc, InvalidRequestError):
            return exc
        return InvalidRequestError(f"{param_of(spec)} does not compile with xgrammar: "
                                   f"{str(exc).strip() or type(exc).__name__}", param=param_of(spec))

    def new_matcher(self, compiled: Any) -> "XgrammarMatcher":
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))


class XgrammarMatcher:
    """One sequence's ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for i, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                if i:
                    self.matcher.rollback(i)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def may_end(self) -> bool:
        return self.matcher.is_completed()

    def fork(self) -> "XgrammarMatcher":
        return XgrammarMatcher(self.matcher.fork())
