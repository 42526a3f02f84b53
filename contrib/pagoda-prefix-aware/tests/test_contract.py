"""pagoda-prefix-aware meets the scheduler contract (pagoda's conformance kit drives it through
randomised streams with shared prefixes, preemption, swap and aborts), and orders by cached prefix.

``pagoda_conformance`` comes from pagoda's pytest plugin, active wherever pagoda is installed."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling import Scheduler
from pagoda.sequence import Sequence

from pagoda_prefix_aware.scheduler import PrefixAwareScheduler


def test_prefix_aware_meets_the_scheduler_contract(pagoda_conformance):
    pagoda_conformance.check_scheduler(PrefixAwareScheduler)
    # a guard short enough to fire often in the kit's streams
    pagoda_conformance.check_scheduler(PrefixAwareScheduler, options=dict(max_wait_steps=3, lookahead=2))


def _scheduler(max_wait_steps: int) -> Scheduler:
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    sched_cfg = SchedulerConfig("prefix-aware", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                                enable_chunked_prefill=True, long_prefill_token_threshold=0, max_waiting_requests=None)
    cache_cfg = CacheConfig(4, 0, "auto", True, 64, 0, "recompute", "paged")
    return Scheduler(sched_cfg, cache_cfg, kv, PrefixAwareScheduler, dict(max_wait_steps=max_wait_steps))


def _request(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))


def test_a_cached_prefix_jumps_the_queue_until_the_guard_fires():
    for max_wait_steps, want_first in ((100, "hit"), (1, "miss")):
        scheduler = _scheduler(max_wait_steps)
        warm = _request("warm", list(range(100, 116)))
        scheduler.kv.allocate_slots(warm, 16)  # its 4 full blocks enter the prefix cache
        scheduler.kv.free(warm)
        scheduler.add_request(_request("miss", list(range(500, 516))))
        scheduler.add_request(_request("hit", list(range(100, 116)) + [7]))
        scheduler.policy.num_steps += 1  # the miss has now waited one step
        sched = scheduler.schedule()
        assert [r.request_id for r in sched.requests] == [want_first]
