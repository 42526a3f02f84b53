"""The conformance kit (pagoda.testing): every built-in passes it, and deliberately broken plugins are caught
with a message that says what broke."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from pagoda import PLUGIN_API_VERSION, hookimpl
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.plugins.attention.cpu_backend import CpuAttentionBackend
from pagoda.plugins.schedulers.fcfs import FCFSPolicy
from pagoda.plugins.schedulers.priority import PriorityPolicy, priority_key
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling.sampler import Sampler, SamplerOutput
from pagoda.sequence import SequenceStatus
from pagoda.testing import (AttentionCase, ContractError, check_attention_backend, check_kv_allocator, check_proposer,
                            check_quant_method, check_sampler, check_scheduler)
from quant_helpers import (dequantize_groups, group_of_columns, pack_along_cols, pack_along_rows, pack_awq,
                           quantize_groups)


def paged(cache_config, num_blocks):
    return PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


@pytest.mark.parametrize("policy", [FCFSPolicy, PriorityPolicy])
def test_the_built_in_policies_meet_the_contract(policy):
    check_scheduler(policy)


def test_the_paged_allocator_meets_the_contract():
    check_kv_allocator(paged)


# ---- broken plugins the kit must catch ---------------------------------------------------------------


class EagerPolicy(FCFSPolicy):
    """Advances progress as soon as a request is scheduled, before anything ran (what a step that fails cannot
    undo)."""

    def on_request_scheduled(self, request, num_new_tokens):
        request.num_computed_tokens += num_new_tokens


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


class EarliestDeadlineFirst(PriorityPolicy):
    """A deadline policy (the priority is the deadline) whose planted bugs the tests below switch on."""


class VictimOutsideCandidates(EarliestDeadlineFirst):
    """Picks the victim among all running requests, scheduled this step or not, and by the wrong end."""

    def choose_victim(self, candidates):
        return min(self.scheduler.running, key=lambda r: (r.priority, r.arrival_time))


class PreemptsByHand(EarliestDeadlineFirst):
    """Makes room for an urgent arrival by moving the latest-deadline running request back by hand."""

    def preempt_for_arrivals(self, out):
        s = self.scheduler
        if s.waiting and s.running and s.waiting[0].priority < s.running[-1].priority:
            victim = s.running.pop()
            s.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.PREEMPTED
            s.waiting.insert(0, victim)


class PreemptsBusy(EarliestDeadlineFirst):
    """``priority``'s preemption for arrivals without its is_busy() check: right one step at a time, wrong with
    steps in flight."""

    def preempt_for_arrivals(self, out):
        s = self.scheduler
        head = next(iter(s.waiting), None)
        if head is None or s.would_fit(head):
            return
        for victim in [r for r in s.running if priority_key(r) > priority_key(head)][::-1]:
            s.preempt(victim, out)
            if s.would_fit(head):
                return


class AgingKey(FCFSPolicy):
    """Ages waiting requests: a key that changes while its request waits."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.num_steps = 0

    def on_step_start(self):
        self.num_steps += 1

    def waiting_key(self, request):
        return (request.priority - self.num_steps, request.arrival_time)


class NeverAdmits(FCFSPolicy):
    """Reads the default of may_admit as "no": nothing ever starts."""

    def may_admit(self, request):
        return False


class RefreeingAllocator(DoubleFreeAllocator):
    pass


def refreeing(cache_config, num_blocks):
    return RefreeingAllocator(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


WHERE = (r"seed \d+, (step|operation) \d+, in [^:]+: .+\. Rule broken: .+\. Most likely at fault: (the "
         r"scheduler's|the policy's|the KV allocator's) \w+\(\)")


@pytest.mark.parametrize("broken, message", [
    (EagerPolicy, r"in schedule\(\): schedule\(\) wrote p\d+-\d's progress: num_computed_tokens \d+ -> \d+.*only "
                  r"update\(\).* at fault: the policy's on_request_scheduled\(\)"),
    (VictimOutsideCandidates, r"in schedule\(\), its call of choose_victim\(\): choose_victim returned p\d+-\d, "
                              r"which is not one of its \d+ candidates .* at fault: the policy's choose_victim\(\)"),
    (PreemptsByHand, r"in schedule\(\), the policy's preempt_for_arrivals\(\): p\d+-\d moved from the running queue "
                     r"to the waiting queue inside preempt_for_arrivals\(\), without a call of preempt\(\)\. Rule "
                     r"broken: .*a running request leaves the running queue only through "
                     r"self\.scheduler\.preempt\(request, out\)"),
    (AgingKey, r"in waiting_key\(\): waiting_key\(p\d+-\d\) was \(.*\) when it joined the waiting queue and is "
               r"\(.*\) now, while it still waits\. Rule broken: a key does not change while its request is queued"),
    (NeverAdmits, r"in the request stream: p\d+-\d arrived at step \d+ and is still waiting \d+ steps later\. Rule "
                  r"broken: liveness: every request finishes within \d+ steps of its arrival\. Most likely at "
                  r"fault: the policy's may_admit\(\)"),
    (PreemptsBusy, r"two steps in flight\), seed 0, step \d+, in schedule_excluding\(\): the PreemptsBusy policy "
                   r"preempted p\d+-\d, which is in a step still in flight.*Rule broken: a busy request \(in a step "
                   r"still in flight\) is never preempted\. Most likely at fault: the policy's "
                   r"preempt_for_arrivals\(\)"),
])
def test_a_broken_scheduler_is_caught_with_what_broke_where_and_whose_fault(broken, message):
    with pytest.raises(ContractError, match=message) as info:
        check_scheduler(broken, seeds=1)
    assert re.search(WHERE, str(info.value)), str(info.value)


def test_the_scheduler_streams_carry_priorities_and_deadlines():
    seen = []

    class Recording(FCFSPolicy):
        def on_request_added(self, request):
            seen.append(request.priority)

    check_scheduler(Recording, seeds=1)
    assert {0, 1, 2} <= set(seen) and max(seen) > 10 and len(set(seen)) > 10


def test_a_double_free_in_a_scheduler_stream_is_reported_as_a_double_free_of_free():
    with pytest.raises(ContractError, match=r"seed 0, step \d+, in the KV allocator's free\('p\d+-\d'\): a double "
                                            r"free: free\('p\d+-\d'\), which held no blocks \(already freed\), put "
                                            r"\d+ blocks back .* at fault: the KV allocator's free\(\)"):
        check_scheduler(FCFSPolicy, allocator=refreeing, seeds=1)


def test_an_allocator_that_gives_blocks_back_twice_is_caught_as_a_double_free():
    with pytest.raises(ContractError, match=r"operation \d+, in free\('s\d+'\) of a sequence freed before: a double "
                                            r"free: .* blocks reported free") as info:
        check_kv_allocator(double_free, seeds=1)
    assert re.search(WHERE, str(info.value)), str(info.value)


class StrictFree(PagedKVCacheManager):
    """Refuses to free an id it never handed blocks to."""

    def free(self, request):
        rid = request if isinstance(request, str) else request.request_id
        if rid not in self._tables and rid not in self.__dict__.setdefault("ever", set()):
            raise KeyError(rid)
        self.ever.add(rid)
        super().free(request)


def strict_free(cache_config, num_blocks):
    return StrictFree(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


def test_an_allocator_whose_free_of_an_unknown_id_raises_is_caught():
    with pytest.raises(ContractError, match=r"in free\('never-allocated-\d+'\) of an id never allocated: free\(\) "
                                            r"raised KeyError.*Rule broken: freeing an unknown id changes nothing"):
        check_kv_allocator(strict_free, seeds=1)


# ---- strict contracts --------------------------------------------------------------------------------


class PeekingPolicy(FCFSPolicy):
    """Reads its allocator's private free queue: works with the paged allocator today, breaks tomorrow."""

    def on_step_start(self):
        self.num_free_seen = len(self.scheduler.kv._free)


class PeekingPlugin:
    @hookimpl
    def pagoda_schedulers(self):
        return {"peeking": PeekingPolicy}


def test_strict_contracts_name_an_attribute_a_plugin_uses_outside_a_protocol():
    from pagoda import SamplingParams
    from pagoda.testing import StrictContracts

    strict = StrictContracts({"peeking": PeekingPlugin()})
    llm = strict.llm(scheduling_policy="peeking", max_num_seqs=2, kv_cache_memory_bytes=8 << 20)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert strict.violations == {"KVCacheManager._free is used but not in the Protocol"}
    with pytest.raises(ContractError, match=r"outside their Protocols .*\n  KVCacheManager._free is used"):
        strict.assert_clean()


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


# ---- attention backends ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_cpu_attention_backends_meet_the_contract(backend):
    check_attention_backend(PluginManager().load().get("pagoda_attention_backends", backend, "test").factory)


def test_the_triton_backend_meets_the_contract_on_a_small_case(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU runs the Triton kernels interpreted: one small case
    from pagoda.plugins.attention.triton_backend import TritonAttentionBackend

    small = AttentionCase(2, 1, 32, 16, context_lens=(5, 0), query_lens=(1, 3))
    check_attention_backend(TritonAttentionBackend, dtypes=(torch.float32,), cases=(small,))


class OffByAScale(CpuAttentionBackend):
    """Uses 1/sqrt(head_dim) instead of the layer's softmax scale."""

    def forward(self, layer, q, k, v, kv_cache, metadata):
        class Unscaled:
            scale = q.shape[-1] ** -0.5
            k_scale = v_scale = 1.0

        return super().forward(Unscaled(), q, k, v, kv_cache, metadata)


class StraySlot(CpuAttentionBackend):
    """Also writes each step's first key into block 0's first slot, whoever holds it."""

    def forward(self, layer, q, k, v, kv_cache, metadata):
        result = super().forward(layer, q, k, v, kv_cache, metadata)
        kv_cache.view(-1)[0] = 1.0
        return result


class ScrubsIdleBlocks(CpuAttentionBackend):
    """Zeroes every block the step's block tables do not name, as if they were free: they may hold other
    sequences' K/V (waiting, swapped in later, cached prefixes)."""

    def forward(self, layer, q, k, v, kv_cache, metadata):
        named = set(metadata.block_tables.flatten().tolist())
        for block in range(kv_cache.shape[1]):
            if block not in named:
                kv_cache[:, block] = 0
        return super().forward(layer, q, k, v, kv_cache, metadata)


@pytest.mark.parametrize("broken, message", [
    (OffByAScale, r"step \d, in forward\(\): the output differs from dense attention .* with the layer's softmax "
                  r"scale .* at fault: the backend's forward\(\)"),
    (StraySlot, r"block \d+, which no sequence holds, was written"),
    (ScrubsIdleBlocks, r"seed 0, step 1, in forward\(\): block \d+, which no sequence holds, was written \(its bytes "
                       r"were all 0x5a before the step\)\. Rule broken: forward\(\) writes K/V only into the slots "
                       r"slot_mapping names"),
])
def test_a_broken_attention_backend_is_caught_with_what_broke(broken, message):
    with pytest.raises(ContractError, match=message):
        check_attention_backend(broken, dtypes=(torch.float32,))


# ---- samplers --------------------------------------------------------------------------------------


def test_the_default_sampler_meets_the_contract():
    check_sampler(Sampler)


class IgnoresTemperature(Sampler):
    def __call__(self, logits, requests):
        return super().__call__(logits, [_with(r, temperature=1.0 if r.sampling_params.temperature else 0.0)
                                         for r in requests])


class IgnoresBans(Sampler):
    def __call__(self, logits, requests):
        return SamplerOutput(logits.argmax(dim=-1).tolist())


class BatchDependentSeeds(Sampler):
    def __call__(self, logits, requests):
        for r in requests:
            r.seed = None if len(requests) > 1 else r.seed
        return super().__call__(logits, requests)


def _with(seq, **changes):
    import dataclasses

    return dataclasses.replace(seq, sampling_params=dataclasses.replace(seq.sampling_params, **changes))


@pytest.mark.parametrize("broken, message", [(IgnoresTemperature, "temperature=0.5.* from the distribution"),
                                             (IgnoresBans, "EOS banned"),
                                             (BatchDependentSeeds, "must not depend on its batch")])
def test_a_broken_sampler_is_caught_with_what_broke(broken, message):
    with pytest.raises(ContractError, match=message):
        check_sampler(broken)


# ---- quantization methods ----------------------------------------------------------------------------


def awq_tensors(out_features, in_features, gen, group=32):
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    g_idx = group_of_columns(in_features, group)
    q, scales, zeros = quantize_groups(w, 4, g_idx, sym=False)
    tensors = {"qweight": pack_awq(q.t()), "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}
    return tensors, dequantize_groups(q, scales, zeros, g_idx)


def gptq_tensors(out_features, in_features, gen, group=64):
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    perm = torch.randperm(in_features, generator=gen)
    g_idx = group_of_columns(in_features, group, perm)
    q, scales, zeros = quantize_groups(w, 4, g_idx, sym=True)
    tensors = {"qweight": pack_along_rows(q.t(), 4), "qzeros": pack_along_cols((zeros - 1).t(), 4),
               "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    return tensors, dequantize_groups(q, scales, zeros, g_idx)


def test_awq_meets_the_contract():
    from pagoda.plugins.quant.awq import AWQConfig

    check_quant_method(AWQConfig, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True},
                       awq_tensors)


def test_gptq_with_act_order_meets_the_contract():
    from pagoda.plugins.quant.gptq import GPTQConfig

    check_quant_method(GPTQConfig, {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True,
                                    "sym": True}, gptq_tensors)


def test_online_fp8_meets_the_contract():
    from pagoda.plugins.quant.fp8 import Fp8Config

    check_quant_method(Fp8Config)


def test_a_quant_method_that_drops_a_zero_point_is_caught():
    from pagoda.plugins.quant.awq import AWQConfig

    def no_zeros(out_features, in_features, gen):
        tensors, _ = awq_tensors(out_features, in_features, gen)
        w = torch.randn(out_features, in_features, generator=gen)
        return tensors, w / in_features ** 0.5  # a reference the packed tensors do not hold

    with pytest.raises(ContractError, match="from the reference"):
        check_quant_method(AWQConfig, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True},
                           no_zeros)


# ---- the pytest plugin -------------------------------------------------------------------------------

PLUGIN_USER_TESTS = '''
from pagoda.scheduling import SchedulingPolicy


class NeverAdmits(SchedulingPolicy):
    def may_admit(self, request):
        return False


def test_fcfs(pagoda_conformance):
    pagoda_conformance.check_scheduler(SchedulingPolicy)


def test_never_admits(pagoda_conformance):
    pagoda_conformance.check_scheduler(NeverAdmits)
'''


def run_pytest_here(capsys, monkeypatch, directory, *args: str) -> tuple[int, str]:
    """``pytest ARGS DIRECTORY`` in this process, from ``directory``, with the plugins pytest finds installed (its
    entry points): the exit status and the output."""
    monkeypatch.chdir(directory)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the run's own test modules are imported by their path
    modules = set(sys.modules)
    capsys.readouterr()
    try:
        status = pytest.main([*args, "-p", "no:cacheprovider", "--import-mode=importlib", str(directory)])
    finally:
        for name in set(sys.modules) - modules:  # the run's test modules, not what it imported
            if name.startswith("test_plugin_user"):
                del sys.modules[name]
    return status, capsys.readouterr().out


def test_the_kit_is_a_pytest_plugin_wherever_pagoda_is_installed(tmp_path, capsys, monkeypatch):
    """A plugin package's tests use the kit's fixture with no conftest.py; the broken scheduler's failure
    says what broke. pytest runs them in this process, loading the kit by pagoda's pytest11 entry point (a plugin
    package's own tests run it in a pytest process of their own: test_contrib_plugin.py)."""
    (tmp_path / "test_plugin_user.py").write_text(PLUGIN_USER_TESTS)
    status, out = run_pytest_here(capsys, monkeypatch, tmp_path, "-q", "--pagoda-seeds", "1")
    assert status == pytest.ExitCode.TESTS_FAILED and "1 failed, 1 passed" in out, out
    assert "ContractError" in out and "liveness: every request finishes" in out, out
    _, header = run_pytest_here(capsys, monkeypatch, tmp_path, "--fixtures")
    assert f"plugin API {PLUGIN_API_VERSION}" in header
    assert all(f"{name} -- " in header or f"{name} [" in header for name in ("pagoda_conformance", "pagoda_strict_llm"))


def test_the_kit_shows_its_public_checks_and_the_guide_documents_each():
    import pathlib

    import pagoda.testing

    names = dir(pagoda.testing)
    assert names == pagoda.testing.__all__ and "check_lora_backend" in names and "importlib" not in names
    guide = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    assert [n for n in names if n.startswith("check_") and f"`{n}(" not in guide and f"`{n}`" not in guide] == []
