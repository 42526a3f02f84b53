"""The ``fair`` scheduling policy: tenants share the engine by the service each received (virtual token counters)."""

from collections import Counter

import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.plugins.schedulers.fair import IDLE_GRACE_STEPS, OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, FairPolicy
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling import Scheduler
from pagoda.sequence import Sequence
from pagoda.step import RunnerOutput
from pagoda.testing import check_scheduler


def make(max_num_seqs=8, num_blocks=64, weights=(), budget=64, step_seqs=0, step_ms=0.0, num_swap_blocks=0):
    sched_cfg = SchedulerConfig(policy="fair", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=256, enable_chunked_prefill=True, long_prefill_token_threshold=0,
                                max_waiting_requests=None)
    mode = "swap" if num_swap_blocks else "recompute"
    cache_cfg = CacheConfig(4, 0, "auto", False, num_blocks, 0, mode, "paged")
    options = dict(tenant_weights=dict(weights), step_seqs=step_seqs, step_ms=step_ms)
    return Scheduler(sched_cfg, cache_cfg, PagedKVCacheManager(num_blocks, 4, False, num_swap_blocks), FairPolicy,
                     options)


_ids = iter(range(10 ** 6))


def seq(tenant, prompt_len=4, max_tokens=50):
    return Sequence(f"r{next(_ids)}", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens,
                    ignore_eos=True), tenant=tenant)


def step(s, seconds_per_step=None, seconds_per_seq=None):
    """One step; with the two costs given, its execution is reported to have taken
    ``seconds_per_step + seconds_per_seq * sequences`` (``RunnerOutput.execute_seconds``)."""
    out = s.schedule()
    result = RunnerOutput.empty(len(out.requests))
    for i, r in enumerate(out.requests):
        if out.num_computed_before[i] + out.num_new_tokens[i] >= r.num_tokens:
            result.sampled_token_ids[i] = [7]
    if seconds_per_step is not None:
        result.execute_seconds = seconds_per_step + seconds_per_seq * len(out.requests)
    s.update(out, result)
    return out


def test_fair_without_bounds_passes_the_scheduler_kit():
    check_scheduler(FairPolicy, options=dict(step_seqs=0, step_ms=0))


def test_fair_with_its_default_bounds_passes_the_scheduler_kit():
    check_scheduler(FairPolicy)


def test_one_tenant_schedules_as_fcfs_does():
    s = make()
    reqs = [seq("a") for _ in range(12)]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert [r.request_id for r in out.requests] == [r.request_id for r in reqs[:8]]
    assert not out.preempted


def test_a_small_tenant_is_admitted_before_a_flooding_one():
    s = make(max_num_seqs=4)
    flood = [seq("heavy") for _ in range(10)]
    for r in flood:
        s.add_request(r)
    for _ in range(3):
        step(s)
    light = seq("light")
    s.add_request(light)
    out = step(s)
    # the light tenant had no service: it takes a seat from the tenant holding more than its share at once
    assert light in out.requests
    assert out.preempted and all(r.tenant == "heavy" for r in out.preempted)
    assert sum(r.tenant == "heavy" for r in s.running) == 3


def test_no_preemption_for_a_tenant_that_holds_its_share():
    s = make(max_num_seqs=4)
    for r in [seq("a"), seq("a"), seq("b"), seq("b")]:
        s.add_request(r)
    step(s)
    s.add_request(seq("b"))
    out = step(s)
    assert not out.preempted
    assert s.num_waiting == 1


def test_service_is_counted_in_weighted_tokens():
    s = make(weights=(("gold", 2.0),))
    gold, plain = seq("gold", prompt_len=8, max_tokens=3), seq("plain", prompt_len=8, max_tokens=3)
    s.add_request(gold)
    s.add_request(plain)
    step(s)  # the prompts, and the first token of each
    per_request = PROMPT_TOKEN_COST * 8 + OUTPUT_TOKEN_COST * 1
    assert s.policy.tenant_counters() == {"gold": pytest.approx(per_request / 2), "plain": pytest.approx(per_request)}
    step(s)
    assert s.policy.tenant_counters()["plain"] == pytest.approx(per_request + OUTPUT_TOKEN_COST)


def test_waiting_order_follows_the_counters_and_a_returning_tenant_saves_nothing():
    s = make(max_num_seqs=1)
    a = seq("a", max_tokens=3)
    s.add_request(a)
    while not a.is_finished:
        step(s)
    served_a = s.policy.tenant_counters()["a"]
    # b arrives while c is served: b's counter starts level with c's, not at 0
    c = seq("c", max_tokens=40)
    s.add_request(c)
    for _ in range(5):
        step(s)
    b = seq("b")
    s.add_request(b)
    assert s.policy.tenant_counters()["b"] == pytest.approx(s.policy.tenant_counters()["c"])
    # a comes back: it keeps its own (higher) counter or starts level with the others, whichever is more
    a2 = seq("a")
    s.add_request(a2)
    assert s.policy.tenant_counters()["a"] >= served_a
    assert s.policy.order_waiting(list(s.waiting))[0].tenant in ("b", "a")


def tenants_of(out):
    return Counter(r.tenant for r in out.requests)


def test_a_flooding_tenant_runs_only_its_part_of_each_step_while_another_is_active():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=4)
    for _ in range(20):
        s.add_request(seq("heavy", max_tokens=200))
    assert tenants_of(step(s)) == {"heavy": 20}  # alone, it runs its whole batch
    light = seq("light", max_tokens=3)
    s.add_request(light)
    while not light.is_finished:
        # the light tenant runs every step, the heavy one the rest of the four sequences; the others wait
        # with their KV blocks (nothing is preempted)
        out = step(s)
        assert tenants_of(out) == {"light": 1, "heavy": 3} and not out.preempted
    # the light tenant may send its next request at once: the steps stay bounded for a while
    for _ in range(IDLE_GRACE_STEPS):
        assert tenants_of(step(s)) == {"heavy": 4}
    assert tenants_of(step(s)) == {"heavy": 20}


def test_the_step_is_split_by_weight_and_every_active_tenant_runs():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=8, weights=(("gold", 3.0),))
    s.add_request(seq("light", max_tokens=100))
    for _ in range(10):
        s.add_request(seq("gold", max_tokens=100))
        s.add_request(seq("plain", max_tokens=100))
    step(s)
    # light takes its one; the seven left go 3:1 between gold and plain (5.25 and 1.75, rounded down)
    assert tenants_of(step(s)) == {"light": 1, "gold": 5, "plain": 1}
    # more tenants with work than the bound: each still runs one sequence a step
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=4)
    for t in range(10):
        s.add_request(seq(f"t{t}", max_tokens=100))
    for _ in range(3):
        assert tenants_of(step(s)) == {f"t{t}": 1 for t in range(10)}


def test_heavy_tenants_alone_together_run_their_whole_batch():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=4)
    for _ in range(10):
        s.add_request(seq("a", max_tokens=100))
        s.add_request(seq("b", max_tokens=100))
    step(s)
    assert tenants_of(step(s)) == {"a": 10, "b": 10}


def test_a_tenant_at_its_part_starts_no_new_sequence_in_that_step():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=4)
    s.add_request(seq("light", max_tokens=100))
    for _ in range(10):
        s.add_request(seq("heavy", max_tokens=100))
    out = step(s)
    assert tenants_of(out) == {"light": 1, "heavy": 3}
    assert s.num_running == 4 and s.num_waiting == 7


def test_tenant_weights_are_checked():
    with pytest.raises(ConfigError, match="tenant weight"):
        EngineArgs.build(tenant_weights="alice=0")
    assert EngineArgs(tenant_weights="alice=2, bob=0.5").tenant_weights


def test_the_older_fair_flags_set_the_policy_s_options():
    config = EngineArgs.build(scheduling_policy="fair", tenant_weights="alice=2", fair_step_seqs=4,
                              fair_step_ms=0).create_engine_config()
    assert config.scheduler.policy_options == {"tenant_weights": {"alice": 2.0}, "step_seqs": 4, "step_ms": 0}
    config = EngineArgs.build(scheduling_policy="fair",
                              scheduler_options={"step_seqs": 3}).create_engine_config()
    assert config.scheduler.policy_options == {"step_seqs": 3}


def test_a_fair_flag_with_another_policy_says_which_policy_it_belongs_to():
    with pytest.raises(ConfigError, match="--fair-step-seqs is an option of the fair scheduling policy, not of "
                                          "'fcfs'; add --scheduling-policy fair"):
        EngineArgs.build(fair_step_seqs=4).create_engine_config()
    with pytest.raises(ConfigError, match="--fair-step-ms and --scheduler-options both set the fair policy's "
                                          "'step_ms'"):
        EngineArgs.build(scheduling_policy="fair", fair_step_ms=10,
                         scheduler_options={"step_ms": 5}).create_engine_config()


@pytest.mark.parametrize("options, message", [
    ({"step_sqes": 4}, "the 'fair' scheduling policy has no option 'step_sqes' .*its options are "
                       "tenant_weights, step_seqs, step_ms"),
    ({"step_seqs": -1}, "option step_seqs is -1; give an integer >= 0"),
    ({"step_ms": "fast"}, "option step_ms is 'fast'; give a number >= 0"),
    ({"tenant_weights": {"alice": 0}}, "the weight of 'alice' is 0; give a positive number"),
    ({"tenant_weights": [1, 2]}, "option tenant_weights must map tenant names to weights"),
])
def test_a_wrong_fair_option_is_refused_naming_it(options, message):
    from pagoda.registry.plugin_manager import get_plugin_manager
    from pagoda.scheduling import build_scheduler

    sched_cfg = SchedulerConfig("fair", 4, 64, 256, True, 0, None, policy_options=options)
    cache_cfg = CacheConfig(4, 0, "auto", False, 16, 0, "recompute", "paged")
    with pytest.raises(ConfigError, match=message):
        build_scheduler(get_plugin_manager(), sched_cfg, cache_cfg, PagedKVCacheManager(16, 4, False))


def test_fair_is_a_registered_policy():
    from pagoda.registry.plugin_manager import get_plugin_manager

    assert get_plugin_manager().get("pagoda_schedulers", "fair", "scheduling_policy").factory is FairPolicy


def test_served_tenants_from_a_header_share_the_engine():
    """A real server with --scheduling-policy fair --tenant-source header: a tenant sending one short request
    while another keeps both seats busy is served before the busy tenant's queued requests, with the same
    greedy text as alone; the busy tenant alone is refused (503) beyond --max-waiting-per-tenant."""
    import asyncio

    import openai

    from pagoda import LLM
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.plugins.entrypoints.server import ServerThread, build_app

    llm = LLM(dtype="bfloat16", batch_invariant=True,
              cpu_threads=1, kv_cache_memory_bytes=64 << 20, scheduling_policy="fair",
              max_num_seqs=2, max_waiting_per_tenant=4)
    alone = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                         use_tqdm=False)[0].outputs[0].text
    served = AsyncLLMEngine(llm.engine)
    srv = ServerThread(build_app(served, tenant_source="header")).start()
    try:
        async def run():
            def client(tenant):
                return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120,
                                          default_headers={"x-pagoda-tenant": tenant})
            heavy, light = client("heavy"), client("light")
            finished = []

            async def ask(c, name, prompt, n_tokens):
                resp = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0,
                                                  max_tokens=n_tokens, extra_body={"ignore_eos": True})
                finished.append(name)
                return resp.choices[0].text

            async def until(condition):
                for _ in range(1200):
                    if condition():
                        return
                    await asyncio.sleep(0.025)
                raise AssertionError("the engine never reached the state the test waits for")

            scheduler = llm.engine.scheduler
            flood = [asyncio.create_task(ask(heavy, f"heavy{i}", f"Story {i}:", 24)) for i in range(2)]
            # the heavy tenant holds both seats (its two requests have output: they no longer count as waiting)...
            await until(lambda: sum(s.has_output for s in list(served._streams.values())) == 2)
            flood += [asyncio.create_task(ask(heavy, f"heavy{i}", f"Story {i}:", 24)) for i in range(2, 6)]
            await until(lambda: scheduler.num_waiting == 4)  # ... and four of its requests wait: as many as it may
            with pytest.raises(openai.APIStatusError) as refused:  # its queue is full: it alone is refused
                await ask(heavy, "heavy-refused", "One more:", 4)
            text = await ask(light, "light", "The capital of France is", 4)
            await asyncio.gather(*flood)
            return text, finished, refused.value

        text, finished, refused = asyncio.run(run())
    finally:
        srv.stop()
    assert text == alone
    assert refused.status_code == 503 and "--max-waiting-per-tenant" in refused.message
    assert int(refused.response.headers["retry-after"]) >= 1
    # served before the heavy tenant's queued requests: at most the two that held the seats, and the one or
    # two that took a seat first, finish before it
    assert finished.index("light") <= 3, finished
    counters = llm.engine.scheduler.policy.tenant_counters()
    assert set(counters) >= {"heavy", "light"} and counters["heavy"] > counters["light"]


def test_a_tenant_with_a_few_sequences_beside_a_flood_runs_them_all():
    # three sequences are more than the bound of two, but a small fraction of the flood's: all three run
    s = make(max_num_seqs=64, num_blocks=512, budget=256, step_seqs=2)
    for _ in range(40):
        s.add_request(seq("heavy", max_tokens=100))
    step(s)
    for _ in range(3):
        s.add_request(seq("light", max_tokens=100))
    step(s)
    assert tenants_of(step(s)) == {"light": 3, "heavy": 1}


def test_a_lone_tenant_s_steps_take_the_time_bound_and_its_sequences_take_turns():
    # 10 ms a step plus 10 ms a sequence: a bound of 100 ms fits about 9 sequences of the 20
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=2, step_ms=100.0)
    flood = [seq("heavy", max_tokens=200) for _ in range(20)]
    for r in flood:
        s.add_request(r)
    assert tenants_of(step(s, 0.01, 0.01)) == {"heavy": 20}  # the prompts: nothing measured yet
    assert len(step(s, 0.01, 0.01).requests) == 20  # the first decode step is measured
    sizes = [len(step(s, 0.01, 0.01).requests) for _ in range(30)]
    assert all(2 <= n <= 10 for n in sizes), sizes
    assert all(0.01 + 0.01 * n <= 0.1 + 0.011 for n in sizes[3:]), sizes  # within one sequence of the bound
    # no sequence stalls: each ran its turn, none more than a turn ahead of another
    outputs = [r.num_output_tokens for r in flood]
    assert min(outputs) >= 10 and max(outputs) - min(outputs) <= 2, outputs
    assert s.num_running == 20 and s.num_preemptions == 0


def test_without_a_measured_step_time_a_lone_tenant_runs_its_whole_batch():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=2, step_ms=100.0)
    for _ in range(20):
        s.add_request(seq("heavy", max_tokens=200))
    for _ in range(5):
        assert tenants_of(step(s)) == {"heavy": 20}


def test_a_tenant_arriving_beside_a_time_bounded_one_gets_the_sequence_bound():
    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=2, step_ms=100.0)
    for _ in range(20):
        s.add_request(seq("heavy", max_tokens=200))
    for _ in range(6):
        step(s, 0.01, 0.01)
    light = seq("light", max_tokens=3)
    s.add_request(light)
    while not light.is_finished:
        assert tenants_of(step(s, 0.01, 0.01)) == {"light": 1, "heavy": 1}


def test_swapped_out_sequences_of_a_heavy_tenant_come_back_only_within_its_part_of_the_step():
    from pagoda.step import SchedulerOutput

    s = make(max_num_seqs=32, num_blocks=256, budget=256, step_seqs=2, num_swap_blocks=64)
    heavy = [seq("heavy", max_tokens=200) for _ in range(6)]
    for r in heavy:
        s.add_request(r)
    step(s)
    out = SchedulerOutput()
    for victim in s.running[-2:]:
        s.preempt(victim, out)
    s.update(out, RunnerOutput.empty(0))
    assert s.num_swapped == 2
    light = seq("light", max_tokens=3)
    s.add_request(light)
    while not light.is_finished:
        # there is room to swap both back, but the heavy tenant's part of the step is one sequence
        out = step(s)
        assert tenants_of(out) == {"light": 1, "heavy": 1} and not out.blocks_to_swap_in
        assert s.num_swapped == 2
    for _ in range(IDLE_GRACE_STEPS):
        step(s)
    out = step(s)  # the light tenant is gone: the whole batch, the swapped sequences back in it
    assert s.num_swapped == 0 and tenants_of(out) == {"heavy": 6}
