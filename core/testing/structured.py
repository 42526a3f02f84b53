"""Structured-output backend checks: compiled constraints that allow exactly the tokens they should."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from pagoda.errors import InvalidRequestError
from pagoda.interfaces import StructuredOutputBackendFactory
from pagoda.sampling.structured.bitmask import allocate_bitmask, allowed_tokens
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.testing.contract import ContractError, Where

# (constraint, a text it accepts, a text it must refuse at its first character)
CASES: list[tuple[StructuredOutputsParams, str, str]] = [
    (StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"},
                                                                     "age": {"type": "integer"}},
                                   "required": ["name", "age"]}), '{"name": "Ada", "age": 36}', "[1]"),
    (StructuredOutputsParams(json_object=True), '{"a": [1, 2]}', '"text"'),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "x"),
    (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
    (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"'), "(42)", "42"),
]


def check_structured_output_backend(factory: StructuredOutputBackendFactory, model: Optional[str] = None) -> None:
    """Check a ``pagoda_structured_output_backends`` factory with the tokenizer of ``model`` (a checkpoint
    directory; pagoda's default model if None):

    - each of a JSON schema, any JSON object, a regex, a choice and an EBNF grammar compiles, and a regex
      that cannot compile raises InvalidRequestError naming ``structured_outputs.regex``;
    - along the tokens of a text the constraint accepts, every next token is allowed by the bitmask (the
      whole row written, whatever it held), the end-of-sequence token only once the text is complete
      (``may_end``), and the text's first character of a refused text is not allowed at the start;
    - a token the grammar refuses is refused by ``accept_tokens`` and leaves the matcher as it was;
    - ``rollback(k)`` returns to the bitmask of k tokens earlier, also over a whole match and its
      end-of-sequence token (as speculative decoding rolls back a step's drafts);
    - two matchers of one compiled constraint do not share their place;
    - a matcher's ``fork()`` (optional, 1.8), when it has one and it returns a matcher, starts at the
      matcher's place, and each of the two then moves without the other.

    Raises ContractError.
    """
    from pagoda.engine.components import load_tokenizer
    from pagoda.engine.generation_config import eos_token_ids
    from pagoda.engine.engine_args import EngineArgs

    config = EngineArgs.build(model=model, load_format="dummy").create_engine_config()
    tokenizer = load_tokenizer(config.model.tokenizer, None)
    eos_ids = eos_token_ids(config.model.model, tokenizer)
    eos = eos_ids[0]
    vocab = config.model.vocab_size
    name = getattr(factory, "__name__", repr(factory))
    backend = factory(config.model, tokenizer, eos_ids)
    for n, (spec, good, bad) in enumerate(CASES):
        where = Where(name, "-", _describe(spec)).at(n, "case")
        _check_case(backend, spec, good, bad, tokenizer, eos, vocab, where)
    where = Where(name, "-", "regex '[0-9'").at(len(CASES), "case")
    try:
        backend.compile(StructuredOutputsParams(regex="[0-9"))
    except InvalidRequestError as exc:
        if exc.param != "structured_outputs.regex":
            raise where.fail("compile()", f"the error names {exc.param!r}", "a constraint that does not compile "
                             "raises InvalidRequestError naming its field", "the backend's compile()") from None
    else:
        raise where.fail("compile()", "an unclosed character class compiled", "a constraint that does not compile "
                         "raises InvalidRequestError naming its field", "the backend's compile()")


def _check_case(backend: Any, spec: StructuredOutputsParams, good: str, bad: str, tokenizer: Any, eos: int,
                vocab: int, where: Where) -> None:
    compiled = backend.compile(spec)
    matcher, other = backend.new_matcher(compiled), backend.new_matcher(compiled)
    token_ids = tokenizer.encode(good, add_special_tokens=False)
    refused = tokenizer.encode(bad, add_special_tokens=False)[0]
    masks = []
    for k, token_id in enumerate(token_ids):
        allowed = _allowed(matcher, vocab)
        masks.append(allowed)
        if not allowed[token_id]:
            raise where.fail("fill_bitmask()", f"token {token_id} ({tokenizer.decode([token_id])!r}) after "
                             f"{tokenizer.decode(token_ids[:k])!r} is not allowed, though {good!r} matches",
                             "the bitmask allows every token that continues a match", "the matcher's fill_bitmask()")
        if allowed[eos]:
            raise where.fail("fill_bitmask()", f"the end-of-sequence token is allowed after the incomplete "
                             f"{tokenizer.decode(token_ids[:k])!r}", "the end is allowed only where the grammar may "
                             "end", "the matcher's fill_bitmask() or the backend's stop tokens")
        if k == 0 and allowed[refused] and refused not in token_ids[:1]:
            raise where.fail("fill_bitmask()", f"token {refused} ({tokenizer.decode([refused])!r}) is allowed at the "
                             f"start, though no match begins with {bad!r}", "the bitmask allows only tokens that "
                             "continue a match", "the matcher's fill_bitmask()")
        if k == 0 and refused not in token_ids[:1]:
            if matcher.accept_tokens([refused]):
                raise where.fail("accept_tokens()", f"token {refused} was accepted at the start of {good!r}",
                                 "accept_tokens refuses a token the grammar does not allow",
                                 "the matcher's accept_tokens()")
            if not torch.equal(_allowed(matcher, vocab), allowed):
                raise where.fail("accept_tokens()", "a refused token changed the bitmask", "a refused token leaves "
                                 "the matcher as it was", "the matcher's accept_tokens()")
        if not matcher.accept_tokens([token_id]):
            raise where.fail("accept_tokens()", f"token {token_id} of {good!r} was refused", "accept_tokens takes "
                             "every token the bitmask allows", "the matcher's accept_tokens()")
    if not matcher.may_end() or not _allowed(matcher, vocab)[eos]:
        raise where.fail("may_end() / fill_bitmask()", f"after the whole of {good!r} the grammar may not end",
                         "a complete match may end: may_end() is True and the bitmask allows the end-of-sequence "
                         "token", "the matcher's may_end() or the backend's stop tokens")
    if not torch.equal(_allowed(other, vocab), masks[0]):
        raise where.fail("new_matcher()", "a second matcher of the same constraint is not at its start",
                         "each matcher has its own place in the grammar", "the backend's new_matcher()")
    _check_fork(backend.new_matcher(compiled), token_ids, masks, vocab, where)
    back = min(2, len(token_ids))
    matcher.rollback(back)
    if not torch.equal(_allowed(matcher, vocab), masks[len(token_ids) - back]):
        raise where.fail("rollback()", f"after rollback({back}) the bitmask differs from {back} tokens earlier",
                         "rollback(k) undoes the last k tokens", "the matcher's rollback()")
    # speculative decoding: a step's drafts, the end included, are accepted and then rolled back together
    if not matcher.accept_tokens(token_ids[len(token_ids) - back:]):
        raise where.fail("accept_tokens()", f"the last {back} tokens of {good!r} were refused after rollback({back})",
                         "rollback(k) undoes the last k tokens", "the matcher's rollback()")
    num_accepted = len(token_ids)
    if not matcher.is_terminated():  # a matcher may stop where only the end can follow (llguidance does)
        if not matcher.accept_tokens([eos]):
            raise where.fail("accept_tokens()", f"the end-of-sequence token was refused after {good!r}",
                             "a complete match that has not terminated accepts the end-of-sequence token",
                             "the matcher's accept_tokens() or the backend's stop tokens")
        num_accepted += 1
    matcher.rollback(num_accepted)
    if not torch.equal(_allowed(matcher, vocab), masks[0]):
        raise where.fail("rollback()", f"after accepting {good!r} and the end, rollback({num_accepted}) does not "
                         "return to the start", "rollback(k) undoes any k tokens accepted, the end included",
                         "the matcher's rollback()")


def _check_fork(matcher: Any, token_ids: list[int], masks: list[torch.Tensor], vocab: int, where: Where) -> None:
    """A fork taken halfway through a match starts where the matcher stands; advancing either one leaves the other
    where it was. ``masks[k]``: the tokens allowed after the first k tokens."""
    half = len(token_ids) // 2
    matcher.accept_tokens(token_ids[:half])
    fork = matcher.fork() if hasattr(matcher, "fork") else None
    if fork is None:
        return
    if not torch.equal(_allowed(fork, vocab), masks[half]):
        raise where.fail("fork()", f"a fork taken after {half} tokens does not allow what the matcher allows",
                         "a fork starts at its matcher's place", "the matcher's fork()")
    if half + 1 < len(token_ids):
        fork.accept_tokens(token_ids[half:half + 1])
        if not torch.equal(_allowed(matcher, vocab), masks[half]):
            raise where.fail("fork()", "advancing a fork moved the matcher it was forked from",
                             "a fork and its matcher move independently", "the matcher's fork()")
        matcher.accept_tokens(token_ids[half:])
        if not torch.equal(_allowed(fork, vocab), masks[half + 1]):
            raise where.fail("fork()", "advancing a matcher moved its fork", "a fork and its matcher move "
                             "independently", "the matcher's fork()")


def _allowed(matcher: Any, vocab: int) -> torch.Tensor:
    """The matcher's allowed tokens, ``[vocab]`` bool; the row is filled over ones and over zeros, which must
    agree (a fill writes every bit of its row)."""
    ones = allocate_bitmask(2, vocab)
    matcher.fill_bitmask(ones, 1)
    zeros = torch.zeros_like(ones)
    matcher.fill_bitmask(zeros, 1)
    if not torch.equal(ones[1], zeros[1]):
        raise ContractError("fill_bitmask() left bits of its row as they were: it must write every bit of the row")
    return allowed_tokens(ones[1:], vocab)[0]


def _describe(spec: StructuredOutputsParams) -> str:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return ", ".join(f"{k}={v!r}" for k, v in fields.items() if v not in (None, False))[:80]


