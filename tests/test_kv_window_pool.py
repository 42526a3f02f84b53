"""The KV window pool: layers with a sliding window keep only their window's K/V, in a pool of their own.

The allocator's books alone (slots held while a window covers a block, given back after, prefix hits cut to
what the window layers still hold), the scheduler driving them over a simulated cache that checks every query
reads its own tokens in its window, and tiny random-weight gpt-oss-like and Gemma-3-like checkpoints written
by transformers: the same tokens with the pool on and off and as transformers, through prefix hits, chunked
prefill, preemption and many requests at once, with the pool's stale slots full of large values.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.engine.metrics import PrometheusExporter
from pagoda.execution.window_pool import split_kv_memory
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.kv.window import NULL_SLOT
from pagoda.modeling.default_model import ensure_default_model
from pagoda.sampling_params import SamplingParams as Params
from pagoda.scheduling import Scheduler
from pagoda.sequence import Sequence
from scheduling_sim import POLICIES, SimRunner, assert_kv_consistent, expected_output, make_request

BS = 4


def window_kv(num_blocks: int, num_slots: int, window: int, prefix_caching: bool = True) -> PagedKVCacheManager:
    kv = PagedKVCacheManager(num_blocks, BS, prefix_caching)
    kv.init_window_pool(num_slots, window)
    return kv


def assert_window_consistent(kv: PagedKVCacheManager) -> None:
    """Each block's window count is the requests whose window covers it; those blocks hold distinct slots;
    free, idle and held slots add up to the pool."""
    assert_kv_consistent(kv)
    live = [0] * kv.num_blocks
    for rid, table in kv._tables.items():
        for block in table[kv._window_start.get(rid, 0):]:
            live[block.block_id] += 1
    assert kv._num_live == live
    held = [s for s in kv._slot_of if s != NULL_SLOT]
    assert len(held) == len(set(held)) and NULL_SLOT not in kv._free_slots
    assert sorted(held + kv._free_slots) == list(range(1, kv.num_window_slots + 1))
    for bid, n in enumerate(live):
        assert n == 0 or kv._slot_of[bid] != NULL_SLOT, f"block {bid} is in a window without a slot"
    for bid in kv._idle:
        assert live[bid] == 0 and kv._slot_of[bid] != NULL_SLOT and kv.blocks[bid].block_hash is not None
    for bid, slot in enumerate(kv._slot_of):
        assert slot == NULL_SLOT or live[bid] or bid in kv._idle, f"block {bid} keeps slot {slot} for nothing"


def step_to(kv: PagedKVCacheManager, req: Sequence, num_new: int, hits=()) -> None:
    assert kv.allocate_slots(req, num_new, hits)
    req.num_computed_tokens += num_new + len(hits) * BS
    assert_window_consistent(kv)


def test_a_block_gives_its_slot_back_once_the_window_has_moved_past_it():
    kv = window_kv(32, 6, window=6, prefix_caching=False)
    req = make_request("a", list(range(40)))
    for _ in range(10):  # chunks of 4: the window (6 tokens back from the chunk's first) spans at most 3 blocks
        step_to(kv, req, 4)
        assert kv.num_free_window_slots >= 6 - 3
    assert kv.window_block_table("a")[:7] == [NULL_SLOT] * 7  # (positions < 40 - 6 + 1 = 35: blocks 0..7 out)
    kv.free(req)
    assert kv.num_free_window_slots == 6 and kv._free_slots and not kv._idle
    assert_window_consistent(kv)


def test_the_prefix_cache_gives_up_deep_and_output_blocks_before_a_prompt_s_last_window():
    kv = window_kv(64, 12, window=6)  # a hit's last 2 blocks need slots
    a = make_request("a", list(range(24)))
    step_to(kv, a, 24)
    # decodes at 24 (the window starts at position 19, block 4: blocks 0..3 left) to 33, which leave blocks 4,
    # 5 and then 6, the output's first
    for _ in range(10):
        a.append_output_tokens([7], 1000)
        step_to(kv, a, 1)
    ids = kv.block_table("a")
    # the output's block, then blocks 0 and 1 (deeper than 2 blocks behind the prompt's end) go first; the
    # prompt's last blocks, in the order they were left
    assert list(kv._idle) == [ids[6], ids[1], ids[0], ids[2], ids[3], ids[4], ids[5]]
    kv.free(a)
    assert_window_consistent(kv)


def test_can_allocate_counts_window_slots_as_well_as_blocks():
    kv = window_kv(64, 4, window=4, prefix_caching=False)
    first = make_request("a", list(range(12)))
    step_to(kv, first, 12)  # three fresh blocks, three slots
    second = make_request("b", list(range(100, 108)))
    assert kv.num_free_blocks > 2 and not kv.can_allocate(second, 8)
    assert not kv.allocate_slots(second, 8) and kv.block_table("b") == []
    step_to(kv, first, 1)  # a decode at 12: its window starts at position 9, block 2; blocks 0 and 1 go back
    assert kv.can_allocate(second, 8)
    step_to(kv, second, 8)


def test_a_prefix_hit_is_cut_to_the_blocks_whose_window_slots_remain():
    kv = window_kv(64, 6, window=6)  # a hit of k blocks needs its last ceil(5 / 4) = 2 blocks' slots
    a = make_request("a", list(range(24)))
    step_to(kv, a, 8)
    step_to(kv, a, 8)
    step_to(kv, a, 8)  # at 16 the window starts at block 2: blocks 0 and 1 idle with their (cached) slots
    assert set(kv._idle) == {kv.block_table("a")[0], kv.block_table("a")[1]}
    other = make_request("c", list(range(500, 504)))
    step_to(kv, other, 4)  # no slot is free: block 0's idle one, the least recently released, is taken
    assert kv._slot_of[kv.block_table("a")[0]] == NULL_SLOT and kv._slot_of[kv.block_table("a")[1]] != NULL_SLOT
    # 16 tokens: blocks 2 and 3 hold slots (a's window), so the whole hit stands
    hits, num_cached = kv.get_computed_blocks(make_request("b", list(range(16)) + [900, 901]))
    assert num_cached == 16
    # 8 tokens: blocks 0 and 1, of which 0 lost its slot: no hit at all
    assert kv.get_computed_blocks(make_request("d", list(range(8)) + [900]))[1] == 0
    b = make_request("b", list(range(16)) + [900, 901])
    step_to(kv, b, 2, hits)
    assert kv.window_block_table("b")[2:4] == kv.window_block_table("a")[2:4]
    for req in (a, b, other):
        kv.free(req)
    assert_window_consistent(kv)
    kv.reset_prefix_cache()
    assert kv.num_free_window_slots == 6 and len(kv._free_slots) == 6


class WindowSim(SimRunner):
    """The simulated cache, plus the window pool's: each slot keeps the tokens written into it, and every
    query must find its own tokens at the positions its window covers."""

    def __init__(self, num_blocks: int, num_slots: int, window: int) -> None:
        super().__init__(num_blocks, BS)
        self.window = window
        self.slots: list[list] = [[None] * BS for _ in range(num_slots + 1)]

    def execute(self, sched):
        for src, dst in sched.window_blocks_to_copy:
            self.slots[dst] = list(self.slots[src])
        tables = sched.window_block_tables
        assert len(tables) == len(sched.requests)
        for req, table, start, n in zip(sched.requests, tables, sched.num_computed_before, sched.num_new_tokens):
            for pos in range(start, start + n):
                assert table[pos // BS] != NULL_SLOT, f"{req.request_id} writes position {pos} into the null slot"
                self.slots[table[pos // BS]][pos % BS] = req.all_token_ids[pos]
        for req, table, start, n in zip(sched.requests, tables, sched.num_computed_before, sched.num_new_tokens):
            for pos in range(max(0, start - self.window + 1), start + n):
                seen = self.slots[table[pos // BS]][pos % BS]
                assert seen == req.all_token_ids[pos], f"{req.request_id} reads a stale window slot at {pos}"
        return super().execute(sched)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_scheduler_keeps_every_window_whole_and_leaks_no_slot(prefix_caching):
    rng = random.Random(5)
    num_blocks, num_slots, window = 24, 9, 7
    sched_cfg = SchedulerConfig("fcfs", 4, 12, 8192, True, 0, None)
    cache_cfg = CacheConfig(BS, 0, "auto", prefix_caching, num_blocks, 0, "recompute", "paged")
    kv = window_kv(num_blocks, num_slots, window, prefix_caching)
    scheduler = Scheduler(sched_cfg, cache_cfg, kv, POLICIES["fcfs"], {})
    runner = WindowSim(num_blocks, num_slots, window)
    shared = [rng.randrange(1000) for _ in range(20)]
    requests = []
    for i in range(16):
        prompt = shared[:rng.choice([0, 9, 16, 20])] + [rng.randrange(1000) for _ in range(rng.randrange(3, 30))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        sched = scheduler.schedule()
        scheduler.update(sched, runner.execute(sched))
        assert_window_consistent(kv)
        steps += 1
        assert steps < 2000
    for req in requests:
        assert req.output_token_ids == expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
    assert scheduler.num_preemptions > 0  # the pools are small enough to make requests wait their turn
    assert kv.num_free_blocks == num_blocks and kv.num_free_window_slots == num_slots
    assert all(n == 0 for n in kv._num_live) and not kv._window_start


def test_a_forked_request_copies_its_shared_last_block_in_the_window_pool_too():
    kv = window_kv(32, 8, window=5)
    parent = Sequence("p", list(range(10)), Params(max_tokens=4, n=2))
    step_to(kv, parent, 10)
    child = Sequence("c", list(range(10)), Params(max_tokens=4, n=2))
    kv.fork(parent, child, 10)
    assert_window_consistent(kv)
    assert kv.allocate_slots(child, 1)  # writes position 10 into the shared block 2: a private copy
    (src, dst), = kv.take_window_copies()
    assert src == kv.window_block_table("p")[2] and dst == kv.window_block_table("c")[2] and src != dst
    assert kv.take_block_copies()
    assert_window_consistent(kv)


# ---- the engine, against transformers -------------------------------------------------------------

WINDOW = {"gpt_oss": 16, "gemma3": 24}


def _config(arch: str, vocab: int):
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, initializer_range=0.2)
    if arch == "gpt_oss":  # sinks, a window on every other layer
        return transformers.GptOssConfig(vocab_size=vocab, intermediate_size=40, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=WINDOW[arch], num_hidden_layers=2,
                                         layer_types=["sliding_attention", "full_attention"], **base)
    # two local layers (window 24: not a multiple of the block size) and a global one
    return transformers.Gemma3TextConfig(vocab_size=vocab, intermediate_size=96, sliding_window=WINDOW[arch],
                                         num_hidden_layers=3, **base,
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    default_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(default_dir))
    written = {}
    for arch in WINDOW:
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer)), dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 **({"experts_implementation": "eager"} if arch == "gpt_oss" else {}))
        with torch.no_grad():  # norms off 1, biases and sinks that matter
            for p in model.parameters():
                if p.dim() == 1:
                    torch.nn.init.normal_(p, std=0.5)
        out = tmp_path_factory.mktemp(f"window-{arch}")
        model.save_pretrained(str(out), safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_dir / name, out / name)
        model.generation_config.eos_token_id = None
        written[arch] = (out, model.eval())
    return written


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 30000) for _ in range(n)] for n in lengths]


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.log_softmax(out.logits[0][0].float(), -1)


def _run(llm: LLM, prompts: list[list[int]], n: int = 8, logprobs: int | None = 5):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _engine(path, pool: str, **kwargs) -> LLM:
    args = dict(dtype="float32", max_model_len=512, cpu_threads=1, block_size=16, kv_window_pool=pool,
                kv_cache_memory_bytes=4 << 20)
    return LLM(model=str(path), **dict(args, **kwargs))


def _stale_fill(llm: LLM) -> None:
    """Every slot of the window pool, the null one included, full of large values before the run."""
    for cache in llm.engine.runner._window_caches:
        cache.fill_(1.0e4)


@pytest.mark.parametrize("arch,backend,chunk", [("gpt_oss", "cpu", 40), ("gemma3", "cpu", 16),
                                                ("gemma3", "torch", 64)])
def test_greedy_tokens_and_logprobs_match_with_the_pool_on_and_off_and_transformers(checkpoints, arch, backend,
                                                                                   chunk):
    path, hf = checkpoints[arch]
    prompts = _prompts(1, [100, 173, 300, 131])
    on = _engine(path, "auto", attention_backend=backend, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert on.engine.window_pool is not None and on.engine.window_pool.window == WINDOW[arch]
    _stale_fill(on)
    got_on = _run(on, prompts)
    kv = on.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_window_slots == kv.num_window_slots
    assert not any(kv._num_live)
    del on
    off = _engine(path, "off", attention_backend=backend, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert off.engine.window_pool is None
    got_off = _run(off, prompts)
    del off
    for prompt, a, b in zip(prompts, got_on, got_off):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt, 8)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref_tokens, f"{arch} {len(prompt)} tokens"
        first_on = {t: lp.logprob for t, lp in a.outputs[0].logprobs[0].items()}
        first_off = {t: lp.logprob for t, lp in b.outputs[0].logprobs[0].items()}
        assert first_on == first_off  # the same kernels over the same keys: the same bits
        for t, lp in first_on.items():
            assert lp == pytest.approx(ref_logprobs[t].item(), abs=2e-3)


def test_a_bf16_model_gives_the_same_bits_with_the_pool_on_and_off(checkpoints):
    path, _ = checkpoints["gpt_oss"]
    prompts = _prompts(2, [120, 211, 64])
    runs = []
    for pool in ("auto", "off"):  # the bf16 kernels (AVX-512 BF16 where the CPU has it) over stale slots
        llm = _engine(path, pool, dtype="bfloat16", max_num_batched_tokens=48, max_num_seqs=4)
        assert (llm.engine.window_pool is not None) == (pool == "auto")
        if pool == "auto":
            _stale_fill(llm)
        runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                               for step in o.outputs[0].logprobs]) for o in _run(llm, prompts)])
        del llm
    assert runs[0] == runs[1]


def test_prefix_hits_preemption_and_many_requests_keep_the_tokens(checkpoints):
    path, hf = checkpoints["gpt_oss"]
    rng = random.Random(3)
    shared = [rng.randrange(10, 30000) for _ in range(160)]
    first = shared + [7, 8, 9]
    later = [shared + _prompts(10 + i, [5 + 7 * i])[0] for i in range(6)] + _prompts(20, [120, 250])
    # a small KV cache (32 blocks of the full layer, 17 window slots): four requests of up to 260 tokens do not
    # fit at once, so some wait or are preempted
    small = dict(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=200 << 10)
    on = _engine(path, "auto", **small)
    assert on.engine.window_pool is not None
    _stale_fill(on)
    runs_on = [_run(on, [first]), _run(on, later)]
    assert runs_on[1][0].num_cached_tokens == 160  # the shared prefix's last block kept its window slot
    stats = on.engine.scheduler
    assert stats.num_preemptions > 0, "the small cache should have preempted a request"
    kv = on.engine.kv_manager
    assert (kv.num_blocks, kv.num_window_slots) == (32, 17)
    assert b"pagoda:kv_window_pool_usage_perc" in PrometheusExporter.for_engine(on.engine).render()
    assert kv.window_usage == 0.0
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_window_slots == kv.num_window_slots
    del on
    off = _engine(path, "off", **small)
    runs_off = [_run(off, [first]), _run(off, later)]
    del off
    for got_on, got_off in zip(runs_on, runs_off):
        assert [o.outputs[0].token_ids for o in got_on] == [o.outputs[0].token_ids for o in got_off]
    assert runs_on[1][-1].outputs[0].token_ids == _hf_greedy(hf, later[-1], 8)[0]


def test_repeated_prompts_longer_than_the_window_keep_their_prefix_hits(checkpoints):
    path, _ = checkpoints["gemma3"]
    prompts = _prompts(40, [100] * 8)
    llm = _engine(path, "auto", max_num_seqs=8, kv_cache_memory_bytes=8 << 20)
    assert llm.engine.window_pool is not None
    first, again = _run(llm, prompts, 40, logprobs=None), _run(llm, prompts, 40, logprobs=None)
    # each prompt's tail window outlives the other requests' prefills and outputs
    assert [o.num_cached_tokens for o in again] == [96] * 8
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_the_window_pool_gives_the_full_layers_more_tokens_in_the_same_memory(checkpoints):
    path, _ = checkpoints["gpt_oss"]
    llm = _engine(path, "auto", max_num_seqs=4, kv_cache_memory_bytes=8 << 20)
    plan = llm.engine.window_pool
    # 4 seats x (ceil(15 / 16) + 2) + ceil(2048 / 16) for a step's tokens + 1 seat's window for cached prefixes
    assert plan.num_slots == 4 * 3 + 128 + 1
    # half the layers slide: a main block costs half (4 KiB), and the window pool takes its slots (+ the null one)
    assert plan.num_blocks_without == (8 << 20) // 8192
    assert plan.num_blocks == ((8 << 20) - (plan.num_slots + 1) * 4096) // 4096 == llm.engine.num_blocks
    assert plan.num_blocks / plan.num_blocks_without > 1.8
    del llm


def test_the_split_turns_the_pool_off_when_it_cannot_hold_one_request_step():
    cc = CacheConfig(16, 64 << 10, "auto", True, None, 0, "recompute", "paged")
    sc = SchedulerConfig("fcfs", 8, 2048, 4096, True, 0, None)
    # 64 KiB of 2 layers at 1 KiB a block: 32 blocks, less than one request's step of 2,048 tokens needs
    assert split_kv_memory(cc, sc, {0: 128}, 2, 1024) is None
    big = CacheConfig(16, 64 << 20, "auto", True, None, 0, "recompute", "paged")
    plan = split_kv_memory(big, sc, {0: 128}, 2, 1024)
    assert plan.num_slots == 8 * (8 + 2) + 2048 // 16 + 2 * 8
    assert plan.num_blocks == (64 << 20) // 1024 - (plan.num_slots + 1)


def test_ngram_speculation_with_the_pool_on_keeps_the_greedy_tokens(checkpoints):
    path, hf = checkpoints["gemma3"]
    # the tiny model repeats its tokens, so the n-gram proposer finds drafts (slots handed out, then trimmed)
    prompts = _prompts(30, [100, 160])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = _engine(path, "auto", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20,
                  speculative_config=spec)
    assert llm.engine.window_pool is not None
    got = _run(llm, prompts, 12, logprobs=None)  # (a request asking for logprobs decodes without drafts)
    assert llm.engine.spec_stats.num_draft_tokens > 0
    for prompt, out in zip(prompts, got):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 12)[0]
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_window_slots == kv.num_window_slots


def test_the_pool_turns_itself_off_with_the_offload_tiers_and_says_why(checkpoints, caplog):
    path, _ = checkpoints["gpt_oss"]
    with caplog.at_level("INFO", logger="pagoda"):
        llm = _engine(path, "auto", max_num_seqs=4, kv_cache_memory_bytes=8 << 20, kv_offload_ram=0.01)
    assert llm.engine.window_pool is None
    assert "KV window pool: off (the --kv-offload-* tiers move whole blocks of every layer)" in caplog.text
    del llm
