"""Proposer checks: drafts that fit their slots, and speculation that reproduces plain decoding."""

from __future__ import annotations

import functools
from typing import Any, Optional

from pagoda.interfaces import ProposerFactory
from pagoda.sampling_params import SamplingParams
from pagoda.step import SchedulerOutput
from pagoda.testing.contract import ContractError, Where

PROPOSER_PROMPTS = [
    "The list: apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
    "Hello",
]


def check_proposer(factory: ProposerFactory, speculative_config: Optional[dict] = None,
                   model: Optional[str] = None, num_speculative_tokens: int = 3) -> None:
    """Check a ``pagoda_proposers`` factory: every step its drafts fit their slots (``num_draft_slots``), are
    token ids of the vocabulary and come with ``[num_drafts, vocab]`` probabilities or None; and greedy
    generation with it gives exactly the tokens of plain decoding (the rejection sampler is exact). Runs the
    real engine on ``model`` (default: pagoda's default model), float32. ``speculative_config`` adds keys
    (for example ``{"model": ...}``) to ``method`` and ``num_speculative_tokens``. Raises ContractError."""
    from pagoda.engine.llm import LLM
    from pagoda import hookimpl
    from pagoda.modeling.default_model import ensure_default_model
    from pagoda.registry.plugin_manager import PluginManager

    name = getattr(factory, "__name__", repr(factory))
    checked: list[str] = []  # one entry per propose() call: "" or what was wrong

    def checked_factory(spec_config, engine_config, runner, plugin_manager):
        proposer = factory(spec_config, engine_config, runner, plugin_manager)
        vocab = engine_config.model.vocab_size
        return _CheckedProposer(proposer, vocab, name, checked)

    class Kit:
        @hookimpl
        def pagoda_proposers(self):
            return {"conformance-checked": checked_factory}

    model = model or str(ensure_default_model())
    plain = _plain_tokens(model)
    pm = PluginManager().load()
    pm.register(Kit(), name="conformance-kit")
    spec = {"method": "conformance-checked", "num_speculative_tokens": num_speculative_tokens,
            **(speculative_config or {})}
    try:
        llm = LLM(plugin_manager=pm, speculative_config=spec, **_proposer_engine_options(model))
        speculated = llm.generate(PROPOSER_PROMPTS, _PROPOSER_PARAMS, use_tqdm=False)
    except Exception:
        problems = [c for c in checked if c]
        if problems:  # the engine reports the broken step; say what broke in it
            raise ContractError(problems[0]) from None
        raise
    if not checked:
        raise Where(name, "none (the engine, greedy)").fail(
            "generate()", "propose() was never called", "the engine asks the proposer for drafts every step",
            "the proposer's factory (or speculative_config)")
    for prompt, a, b in zip(PROPOSER_PROMPTS, plain, speculated):
        if b.error is not None:
            raise Where(name, "none (the engine, greedy)").fail(
                "generate()", f"generating {prompt[:30]!r} failed: {b.error}", "speculation never fails a request",
                "the proposer's propose()")
        if a != b.outputs[0].token_ids:
            raise Where(name, "none (the engine, greedy)").fail(
                "generate()", f"greedy tokens with speculation differ from plain decoding for prompt {prompt[:30]!r}: "
                f"{b.outputs[0].token_ids[:8]}... instead of {a[:8]}...", "speculation never changes greedy tokens",
                "the proposer's draft probabilities (a distribution that is not the one the drafts came from)")


_PROPOSER_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _proposer_engine_options(model: str) -> dict:
    return dict(model=model, dtype="float32", max_model_len=512, cpu_threads=1, kv_cache_memory_bytes=64 << 20)


@functools.lru_cache(maxsize=2)
def _plain_tokens(model: str) -> tuple[list[int], ...]:
    """Greedy tokens of the proposer prompts without speculation (computed once per model)."""
    from pagoda.engine.llm import LLM

    outputs = LLM(**_proposer_engine_options(model)).generate(PROPOSER_PROMPTS, _PROPOSER_PARAMS, use_tqdm=False)
    return tuple(o.outputs[0].token_ids for o in outputs)


class _CheckedProposer:
    """Checks each ``propose`` result against the step it was asked for."""

    def __init__(self, proposer: Any, vocab: int, name: str, checked: list[int]) -> None:
        self.proposer, self.vocab, self.name, self.checked = proposer, vocab, name, checked

    def propose(self, sched: SchedulerOutput):
        drafts, probs = self.proposer.propose(sched)
        self.checked.append("")
        self.where = Where(self.name, "none (the engine, greedy)").at(len(self.checked))
        try:
            self._check(sched, drafts, probs)
        except ContractError as exc:
            self.checked[-1] = str(exc)
            raise
        return drafts, probs

    def _check(self, sched: SchedulerOutput, drafts, probs) -> None:
        n = len(sched.requests)
        if len(drafts) != n or len(probs) != n:
            raise self.where.fail("propose()", f"propose() returned {len(drafts)} draft lists and {len(probs)} "
                                  f"distributions for a step of {n} sequences", "one draft list and one distribution "
                                  "(or None) per sequence of the step", "the proposer's propose()")
        for i, (ids, q) in enumerate(zip(drafts, probs)):
            rid = sched.requests[i].request_id
            if len(ids) > sched.num_draft_slots[i]:
                raise self.where.fail("propose()", f"{len(ids)} drafts for {rid}, which has "
                                      f"{sched.num_draft_slots[i]} draft slots", "at most num_draft_slots[i] drafts",
                                      "the proposer's propose()")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab for t in ids):
                raise self.where.fail("propose()", f"drafts {ids} for {rid} are not token ids in [0, {self.vocab})",
                                      "drafts are int token ids of the vocabulary", "the proposer's propose()")
            if q is not None and tuple(q.shape) != (len(ids), self.vocab):
                raise self.where.fail("propose()", f"draft probabilities of shape {tuple(q.shape)} for {rid}, not "
                                      f"({len(ids)}, {self.vocab})", "probabilities are [num_drafts, vocab] or None",
                                      "the proposer's propose()")
