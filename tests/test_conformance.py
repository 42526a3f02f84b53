"""The conformance kit (pagoda.testing): every built-in passes it, and deliberately broken plugins are caught
with a message that says what broke."""

from __future__ import annotations

import pytest

from pagoda.kv_blocks import PagedKVCacheManager
from pagoda.plugins.schedulers.base import FCFSScheduler
from pagoda.plugins.schedulers.priority import PriorityScheduler
from pagoda.testing import ContractError, check_kv_allocator, check_proposer, check_scheduler


def paged(cache_config, num_blocks):
    return PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


@pytest.mark.parametrize("scheduler", [FCFSScheduler, PriorityScheduler])
def test_the_built_in_schedulers_meet_the_contract(scheduler):
    check_scheduler(scheduler)


def test_the_paged_allocator_meets_the_contract():
    check_kv_allocator(paged)


# ---- broken plugins the kit must catch ---------------------------------------------------------------


class OverBudgetScheduler(FCFSScheduler):
    """Gives the first prefill chunk of each step a few tokens more than the budget allows."""

    def __init__(self, scheduler_config, cache_config, kv_manager):
        super().__init__(scheduler_config, cache_config, kv_manager)
        self.max_num_batched_tokens += 5


class EagerScheduler(FCFSScheduler):
    """Advances progress at schedule time, before anything ran (what a step that fails cannot undo)."""

    def schedule(self):
        out = super().schedule()
        for req, n in zip(out.requests, out.num_new_tokens):
            req.num_computed_tokens += n
        return out


class ForgetfulScheduler(FCFSScheduler):
    """Never frees the blocks of a finished sequence."""

    def finish(self, req, status):
        kv_free = self.kv.free
        self.kv.free = lambda request: None
        try:
            super().finish(req, status)
        finally:
            self.kv.free = kv_free


class DoubleFreeAllocator(PagedKVCacheManager):
    """Releases a sequence's blocks again when it is freed a second time (a classic double free)."""

    def free(self, request):
        rid = request if isinstance(request, str) else request.request_id
        freed = self.__dict__.setdefault("freed_tables", {})
        if rid not in self._tables and rid in freed:
            for block in freed.pop(rid):  # blocks someone else may hold by now go back to the pool
                self._free[block.block_id] = block
            return
        freed[rid] = list(self._tables.get(rid, ()))
        super().free(request)


def double_free(cache_config, num_blocks):
    return DoubleFreeAllocator(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


@pytest.mark.parametrize("broken, message", [
    (OverBudgetScheduler, r"batches \d+ tokens, over max_num_batched_tokens=16"),
    (EagerScheduler, r"schedule\(\) moved .* computed tokens .* progress moves only in update\(\)"),
    (ForgetfulScheduler, r"KV blocks were not given back|reported free"),
])
def test_a_broken_scheduler_is_caught_with_what_broke(broken, message):
    with pytest.raises(ContractError, match=message):
        check_scheduler(broken, seeds=1)


def test_an_allocator_that_hands_out_a_block_twice_is_caught():
    with pytest.raises(ContractError, match=r"block \d+ is handed out twice|blocks reported free"):
        check_kv_allocator(double_free, seeds=1)


# ---- proposers --------------------------------------------------------------------------------------


def ngram(spec_config, engine_config, runner, plugin_manager):
    from pagoda.plugins.spec_decode.ngram import NgramProposer

    return NgramProposer(spec_config, engine_config, runner, plugin_manager)


class OneTooMany:
    """Proposes one draft more than the slots allow."""

    def __init__(self, spec_config, engine_config, runner, plugin_manager):
        self.inner = ngram(spec_config, engine_config, runner, plugin_manager)

    def propose(self, sched):
        drafts, probs = self.inner.propose(sched)
        return [d + [d[-1]] if d else d for d in drafts], probs


class WrongTokens:
    """Drafts the right number of tokens, but ones the target would not pick: still exact, only slower."""

    def __init__(self, spec_config, engine_config, runner, plugin_manager):
        pass

    def propose(self, sched):
        return [[7] * k for k in sched.num_draft_slots], [None] * len(sched.requests)


def test_the_ngram_proposer_meets_the_contract():
    check_proposer(ngram, speculative_config={"prompt_lookup_max": 4, "prompt_lookup_min": 1})


def test_drafts_that_are_merely_wrong_still_give_the_plain_tokens():
    check_proposer(WrongTokens)


def test_a_proposer_that_overfills_its_slots_is_caught():
    with pytest.raises(ContractError, match=r"\d+ drafts for .*, which has \d+ draft slots"):
        check_proposer(OneTooMany, speculative_config={"prompt_lookup_max": 4, "prompt_lookup_min": 1})
