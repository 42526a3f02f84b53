"""Bugs a plugin author plants without meaning to, one test each: the conformance kit (pagoda.testing) fails each
with a ContractError naming the rule, the method most likely at fault, the seed and the step."""

from __future__ import annotations

import math
import re

import pytest
import torch

from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.sampling.sampler import Sampler
from pagoda.scheduling import SchedulingPolicy
from pagoda.sequence import SequenceStatus
from pagoda.testing import ContractError, check_kv_allocator, check_sampler, check_scheduler

WHERE = r"seed \d+, (step|operation|batch) [^,]+, in [^:]+: .+\. Rule broken: .+\. Most likely at fault: .+\(\)"


def caught(check, *args, match: str, **kwargs) -> str:
    """The ContractError ``check`` raises, which must match ``match`` and say where it happened."""
    with pytest.raises(ContractError, match=match) as info:
        check(*args, **kwargs)
    message = str(info.value)
    assert re.search(WHERE, message, flags=re.S), message
    return message


def deadline(request):
    """The urgency an earliest-deadline-first policy promises: the priority is the deadline, smaller first."""
    return request.priority


class EarliestDeadlineFirst(SchedulingPolicy):
    """A correct EDF policy (the priority is the request's deadline); the bugs below are planted in subclasses."""

    def key(self, request):
        return (request.priority, request.arrival_time, request.request_id)

    def waiting_key(self, request):
        return self.key(request)

    # the running order stays the default (decodes first, by arrival): the deadline decides admission and victims

    def choose_victim(self, candidates):
        return max(candidates, key=self.key)

    def may_admit(self, request):
        return not self.scheduler.swapped or self.key(request) < self.key(self.scheduler.swapped[0])


def test_a_correct_deadline_policy_passes_with_its_urgency_declared():
    check_scheduler(EarliestDeadlineFirst, seeds=1, urgency=deadline)


def test_the_built_in_priority_policy_keeps_its_promised_order():
    from pagoda.plugins.schedulers.priority import PriorityPolicy

    check_scheduler(PriorityPolicy, seeds=1, urgency=lambda r: r.priority)


class IgnoresDeadlinesInChooseVictim(EarliestDeadlineFirst):
    def choose_victim(self, candidates):
        return candidates[-1]  # the default's newest, whatever its deadline


def test_edf_ignoring_deadlines_in_choose_victim():
    caught(check_scheduler, IgnoresDeadlinesInChooseVictim, seeds=1, urgency=deadline,
           match=r"choose_victim returned [\w-]+ \(urgency \d+, priority \d+\) while [\w-]+ .* is less urgent.*"
                 r"Rule broken: the victim is a least urgent candidate.*Most likely at fault: the policy's "
                 r"choose_victim\(\)")


class PriorityZeroIsNoSLO(EarliestDeadlineFirst):
    def key(self, request):
        return (request.priority or math.inf, request.arrival_time, request.request_id)  # 0 read as "no deadline"


def test_edf_treating_priority_0_as_no_slo():
    caught(check_scheduler, PriorityZeroIsNoSLO, seeds=1, urgency=deadline,
           match=r"(the waiting queue holds p\d+-\d \(urgency \d+, priority \d+\) ahead of the more urgent p\d+-\d "
                 r"\(urgency 0|choose_victim returned p\d+-\d \(urgency 0).*priority 0 is the most urgent")


class ReadsTheWrongPriorityField(EarliestDeadlineFirst):
    def key(self, request):
        return (request.sampling_params.priority, request.arrival_time, request.request_id)


def test_edf_reading_sampling_params_priority_instead_of_the_resolved_one():
    caught(check_scheduler, ReadsTheWrongPriorityField, seeds=1, urgency=deadline,
           match=r"Rule broken: .*read request\.priority")


class RemovesRunningWithoutPreempt(EarliestDeadlineFirst):
    """Makes room for an urgent arrival by moving the latest-deadline running request back by hand."""

    def preempt_for_arrivals(self, out):
        s = self.scheduler
        if s.waiting and s.running and s.waiting[0].priority < s.running[-1].priority:
            victim = s.running.pop()
            victim.status = SequenceStatus.WAITING
            s.waiting.insert(0, victim)


def test_a_running_request_removed_without_preempt():
    caught(check_scheduler, RemovesRunningWithoutPreempt, seeds=1,
           match=r"the policy's preempt_for_arrivals\(\): p\d+-\d moved from the running queue to the waiting queue "
                 r"inside preempt_for_arrivals\(\), without a call of preempt\(\)")


class VictimFromNoCandidates(EarliestDeadlineFirst):
    """Preempts by hand in order_running, returning the order it was given: the request it took out stays in the
    order the scheduler walks, with nobody left to offer choose_victim (whose max() of nothing raised a
    ValueError inside the author's code before)."""

    def order_running(self, running):
        s = self.scheduler
        if s.kv.num_free_blocks < 2 and len(s.running) > 1:
            victim = s.running.pop()
            s.kv.free(victim)
            victim.status = SequenceStatus.PREEMPTED
            s.waiting.insert(0, victim)
        return running


def test_choose_victim_with_no_candidates_after_a_hand_rolled_preemption():
    caught(check_scheduler, VictimFromNoCandidates, seeds=1,
           match=r"in schedule\(\), the policy's order_running\(\): p\d+-\d moved from the running queue to the "
                 r"waiting queue inside order_running\(\), without a call of preempt\(\).*Rule broken: a policy reads "
                 r"the scheduler's queues and never changes them.*Most likely at fault: the policy's order_running\(\)")


def test_the_scheduler_refuses_to_ask_choose_victim_about_no_candidates():
    """Without the kit's watch, the engine's scheduler says what happened instead of calling choose_victim([])."""
    from pagoda.errors import SchedulingPolicyError
    from pagoda.testing.scheduling import SimRunner, _configs, _make_kv
    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduling import Scheduler
    from pagoda.sequence import Sequence

    class TakesEveryoneOut(EarliestDeadlineFirst):
        def order_running(self, running):
            self.scheduler.running.clear()
            return running

    sched_cfg, cache_cfg = _configs(4, 2, 16, 4, "recompute", False, False)
    scheduler = Scheduler(sched_cfg, cache_cfg, _make_kv(None, cache_cfg, 2), TakesEveryoneOut, {})
    runner = SimRunner(2, 4)
    scheduler.add_request(Sequence("a", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True)))
    scheduler.add_request(Sequence("b", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True)))
    with pytest.raises(SchedulingPolicyError, match=r"no running request can be preempted .*choose_victim has no "
                                                    r"candidates.*only through self\.scheduler\.preempt"):
        for _ in range(4):
            sched = scheduler.schedule()
            scheduler.update(sched, runner.execute(sched))


# ---- allocators ---------------------------------------------------------------------------------------------


class RefcountBelowZero(PagedKVCacheManager):
    """Frees a sequence's shared (prefix-cached or forked) blocks twice: their reference count reaches -1."""

    def free(self, request):
        rid = request if isinstance(request, str) else request.request_id
        shared = [b for b in (self._tables.get(rid) or []) if b.ref_cnt > 1]
        super().free(request)
        for block in shared:
            block.ref_cnt -= 1


def refcount_below_zero(cache_config, num_blocks):
    return RefcountBelowZero(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


def test_a_double_free_that_drives_a_reference_count_to_minus_one():
    caught(check_kv_allocator, refcount_below_zero, seeds=2,
           match=r"in the KV allocator's free\('p\d+-\d'\): free\('p\d+-\d'\) gave back \d+ blocks, but \d+ of its "
                 r"\d+ blocks were held by no other sequence.*a reference count dropped twice.*Most likely at fault: "
                 r"the KV allocator's free\(\)")


class MixedEvictionKeys(PagedKVCacheManager):
    """LFU eviction whose key is None for a block never hit and a list otherwise: the two do not compare."""

    def eviction_key(self, block):
        hits = getattr(block, "num_hits", 0)
        return None if not hits else [hits]


def mixed_keys(cache_config, num_blocks):
    return MixedEvictionKeys(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


def test_an_eviction_key_mixing_none_and_lists():
    caught(check_kv_allocator, mixed_keys, seeds=1,
           match=r"TypeError: '<' not supported between .*Rule broken: a key hook's keys are comparable with each "
                 r"other.*Most likely at fault: the KV allocator's eviction_key\(\)")


# ---- samplers -----------------------------------------------------------------------------------------------


class LeakingBans(Sampler):
    """A no-repeat-3-gram sampler that bans every row's n-grams in every row."""

    def process_logits(self, logits, requests):
        banned = set()
        for seq in requests:
            tokens = seq.all_token_ids
            banned |= {tokens[i + 2] for i in range(len(tokens) - 2) if tokens[i:i + 2] == tokens[-2:]}
        if banned:
            logits[:, sorted(banned)] = float("-inf")


def test_sampler_bans_leaking_across_rows():
    caught(check_sampler, LeakingBans, draws=250,
           match=r"batch 4 .*row \d \(history .*\) drew \d+ alone, \d+ in the batch.*Rule broken: a greedy row's "
                 r"token depends on its own history only.*Most likely at fault: the sampler's process_logits\(\)")


class NgramBeforeSuper(Sampler):
    """Bans repeated 3-grams in ``__call__`` before handing the logits to ``super()``: the logprobs it reports
    are then those of the banned distribution, not the model's."""

    def __call__(self, logits, requests):
        for row, seq in enumerate(requests):
            tokens = seq.all_token_ids
            banned = {tokens[i + 2] for i in range(len(tokens) - 2) if tokens[i:i + 2] == tokens[-2:]}
            if banned:
                logits[row, sorted(banned)] = float("-inf")
        return super().__call__(logits, requests)


def test_sampler_ngram_logic_before_super():
    caught(check_sampler, NgramBeforeSuper, draws=250,
           match=r"batch 4 .*row \d: token \d+ has logprob .*Rule broken: logprobs=k gives the drawn token's "
                 r"log-probability")


def test_the_default_sampler_passes_the_history_batches():
    check_sampler(Sampler, draws=250)


# ---- attention backends ---------------------------------------------------------------------------------------


def torch_backend_class():
    from pagoda.plugins.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


class WritesPaddingSlot(torch_backend_class()):
    """Writes K/V by advanced indexing with the raw slot_mapping: a padding token's -1 lands in the last slot of
    the cache, a block nobody holds."""

    def build_metadata(self, batch):
        md = super().build_metadata(batch)
        md.raw_slots = batch.slot_mapping.to(torch.int64)
        return md

    def forward(self, layer, q, k, v, kv_cache, md):
        hkv, num_blocks, bs, d = kv_cache.shape[1:]
        kv_cache[0].view(hkv, num_blocks * bs, d)[:, md.raw_slots] = k.transpose(0, 1).to(kv_cache.dtype)
        return super().forward(layer, q, k, v, kv_cache, md)


def test_a_kv_write_to_padding_slot_minus_one():
    from pagoda.testing import check_attention_backend

    caught(check_attention_backend, WritesPaddingSlot, dtypes=(torch.float32,),
           match=r"step 2 \(padded: token \d+ has slot -1\), in forward\(\): block \d+, which no sequence holds, was "
                 r"written .*it is the last block, where slot -1 of the padding token lands.*Rule broken: forward\(\) "
                 r"writes K/V only into the slots slot_mapping names \(-1: a padding token, written nowhere")


class WritesTheNextBlock(torch_backend_class()):
    """An off-by-one block index: every token's K/V goes one block further than its block table says."""

    def forward(self, layer, q, k, v, kv_cache, md):
        num_blocks, bs = kv_cache.shape[2], kv_cache.shape[3]
        md.slot_mapping = (md.slot_mapping + bs) % (num_blocks * bs)
        return super().forward(layer, q, k, v, kv_cache, md)


def test_an_unowned_block_write_is_named_as_such_not_as_a_wrong_output():
    from pagoda.testing import check_attention_backend

    caught(check_attention_backend, WritesTheNextBlock, dtypes=(torch.float32,),
           match=r"in forward\(\): block \d+, which no sequence holds, was written.*Most likely at fault: the "
                 r"backend's forward\(\) \(its K/V write\)")


def test_the_torch_backend_passes_the_padded_batches():
    from pagoda.testing import check_attention_backend

    check_attention_backend(torch_backend_class())


class CountsUncachedOnly(PagedKVCacheManager):
    """An allocator whose free count leaves out the free blocks that still cache a prefix."""

    @property
    def num_free_blocks(self):
        return sum(1 for block in self._free.values() if block.block_hash is None)


def counts_uncached_only(cache_config, num_blocks):
    return CountsUncachedOnly(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


COUNT_BLAMED = (r"num_free_blocks says \d+ of \d+ blocks are free, but usage [\d.]+ says \d+ are held, so \d+ are free\. "
                r"Rule broken: num_free_blocks counts every block no sequence holds \(blocks that still cache a prefix "
                r"included.*Most likely at fault: the KV allocator's num_free_blocks\(\)")


def test_a_wrong_free_count_names_the_count_not_allocate_slots():
    message = caught(check_kv_allocator, counts_uncached_only, seeds=1,
                     match=r"operation \d+, in free\('s\d+'\): \d+ blocks reported free, not \d+.*" + COUNT_BLAMED)
    assert "allocate_slots" not in message.split("Most likely at fault")[1]


def test_a_wrong_free_count_in_a_request_stream_names_the_count_not_a_lost_block():
    """Through the scheduler the same count looks like blocks free() kept: the kit tells the two apart by the
    allocator's usage, which counts the pool the other way."""
    message = caught(check_scheduler, SchedulingPolicy, allocator=counts_uncached_only, seeds=1,
                     match=r"in the KV allocator's free\('p\d+-\d'\): free\('p\d+-\d'\) gave back \d+ blocks of the \d+ "
                           r"it held alone, by num_free_blocks; " + COUNT_BLAMED)
    assert "reference count" not in message


class IndexCopiesEverySlot(torch_backend_class()):
    """Writes K/V with ``index_copy_`` over the raw slot_mapping: a padding token's -1 is out of range, and the
    write raises inside the backend."""

    def build_metadata(self, batch):
        md = super().build_metadata(batch)
        md.raw_slots = batch.slot_mapping.to(torch.int64)
        return md

    def forward(self, layer, q, k, v, kv_cache, md):
        hkv, num_blocks, bs, d = kv_cache.shape[1:]
        flat = kv_cache[0].reshape(hkv, num_blocks * bs, d)
        flat.index_copy_(1, md.raw_slots, k.transpose(0, 1).to(kv_cache.dtype))
        return super().forward(layer, q, k, v, kv_cache, md)


def test_a_padding_write_that_raises_is_a_contract_error_not_a_raw_index_error():
    from pagoda.testing import check_attention_backend

    caught(check_attention_backend, IndexCopiesEverySlot, dtypes=(torch.float32,),
           match=r"step 2 \(padded: token \d+ has slot -1\), in forward\(\): it raised IndexError: .*index -1.*Rule "
                 r"broken: a backend runs every batch a runner builds, padded ones included.*Most likely at fault: the "
                 r"backend's forward\(\) \(its K/V write of the padding token\)")


class ResetsPerStepStateAtStepStart(EarliestDeadlineFirst):
    """Counts the tokens of the step being built in one dict that on_step_start() resets, and settles them in
    on_step_executed(): right one step at a time; with steps in flight the next step's on_step_start() has
    already emptied the dict when the step ahead is committed (a KeyError inside the author's code before)."""

    def on_step_start(self):
        self.tokens_this_step = {}

    def on_request_scheduled(self, request, num_new_tokens):
        self.tokens_this_step[request.request_id] = num_new_tokens

    def on_step_executed(self, sched, result):
        for request in sched.requests:
            del self.tokens_this_step[request.request_id]


def test_a_hook_that_raises_only_with_steps_in_flight_is_named_with_the_rule_seed_and_step():
    caught(check_scheduler, ResetsPerStepStateAtStepStart, seeds=1,
           match=r"two steps in flight\), seed 0, step \d+, in update\(\) of the step ahead, committed after this step "
                 r"was scheduled: KeyError: 'p\d+-\d'\. Rule broken: a hook answers without raising with steps in "
                 r"flight, where the next step's on_step_start\(\) and on_request_scheduled\(\) run before "
                 r"on_step_executed\(\) of the step ahead.*Most likely at fault: the policy's on_step_executed\(\)")
