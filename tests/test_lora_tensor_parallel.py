"""Multi-LoRA serving over two tensor-parallel ranks gives the tokens of one rank.

One rank is the reference (``test_lora.py`` checks it against PEFT's merged weights). The ranks hold their shard
of every adapter: the fused QKV's B rows by the base weight's heads (the uneven model's single KV head is held by
both ranks and its 3 query heads split 1/2), gate/up's B rows and down_proj's A columns by the MLP split (99 wide:
49/50), o_proj's A columns by the query heads. Adapters are loaded, evicted from memory, moved between slots and
unloaded while the ranks run on the ``mp`` executor (on Ray actors: test_ray_cluster.py); a bad adapter is refused as
on one rank.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.errors import InvalidRequestError
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from lora_helpers import make_adapter
from tiny_models import write_tiny_llama

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 160, 3)), [42] * 9 + [1000, 2000, 3000]]
# two slots for three adapters, two of them in memory: the third adapter's requests wait for a slot, and adapters
# are evicted, read again and copied into slots other adapters held while the ranks run
ENGINE = dict(dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              kv_cache_memory_bytes=8 << 20, cpu_threads=1, max_num_batched_tokens=32, max_num_seqs=8)
SHAPES = {"tiny": dict(),  # 4 query heads over 2 KV heads: one KV head per rank
          "uneven": dict(hidden=96, heads=3, kv_heads=1, head_dim=32, inter=99)}


def model_with_adapters(tmp_path_factory, shape: str) -> tuple[Path, list[LoRARequest]]:
    """A tiny random model of one of ``SHAPES`` and three adapters of it: every projection; attention only with
    rsLoRA; the MLP only at another rank."""
    model_dir = tmp_path_factory.mktemp(f"lora-tp-{shape}")
    write_tiny_llama(model_dir, seed=5, **SHAPES[shape])
    root = tmp_path_factory.mktemp(f"lora-tp-adapters-{shape}")
    adapters = [make_adapter(model_dir, root / "all", seed=31, r=8, alpha=16),
                make_adapter(model_dir, root / "attn-rslora", seed=32, r=4, alpha=8, use_rslora=True,
                             targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
                make_adapter(model_dir, root / "mlp", seed=33, r=16, alpha=8,
                             targets=["gate_proj", "up_proj", "down_proj"])]
    return model_dir, [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request, tmp_path_factory):
    return model_with_adapters(tmp_path_factory, request.param)


def generate(model_dir, loras, tp: int, **options) -> list[tuple[list[int], list[float]]]:
    """Each prompt with the base model and each adapter, interleaved, in one call: the greedy tokens and their
    logprobs."""
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **{**ENGINE, **options})
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(len(loras) + 1)]
        requests = [lora for _ in PROMPTS for lora in (None, *loras)]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
        return [(list(o.outputs[0].token_ids),
                 [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outputs]
    finally:
        llm.engine.shutdown()


def assert_same_tokens(one: list, two: list, num_loras: int) -> None:
    for k, ((tokens_1, logprobs_1), (tokens_2, logprobs_2)) in enumerate(zip(one, two)):
        who = "the base model" if k % (num_loras + 1) == 0 else f"adapter {k % (num_loras + 1) - 1}"
        assert tokens_2 == tokens_1, f"{who} on prompt {k // (num_loras + 1)}: two ranks diverged from one"
        assert max(abs(a - b) for a, b in zip(logprobs_1, logprobs_2)) < 1e-3
    base = [one[k][0] for k in range(0, len(one), num_loras + 1)]
    for j in range(1, num_loras + 1):  # else the comparison proves nothing
        assert [one[k][0] for k in range(j, len(one), num_loras + 1)] != base, f"adapter {j - 1} changed no token"


def test_an_adapter_goes_to_the_other_ranks_by_value(model):
    """Pickled for a worker process, an adapter carries its weights itself, not a shared-memory handle (a file
    descriptor) per tensor."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from pagoda.execution.lora_adapter import load_adapter

    model_dir, loras = model
    llm = LLM(str(model_dir), **ENGINE)
    manager = llm.engine.runner.lora
    adapter = load_adapter(loras[0], manager.targets, manager.packed, 16, torch.float32)
    data = bytes(ForkingPickler.dumps(adapter))
    tensors = [t for parts in (adapter.lora_a, adapter.lora_b) for ts in parts.values() for t in ts if t is not None]
    assert len(data) > sum(t.numel() * t.element_size() for t in tensors)
    copy = pickle.loads(data)
    assert copy.request == adapter.request and copy.scaling == adapter.scaling
    for prefix, parts in adapter.lora_b.items():
        for mine, theirs in zip(parts, copy.lora_b[prefix]):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)


def test_two_ranks_give_one_ranks_tokens_for_adapters_and_the_base_model_in_one_batch(model):
    model_dir, loras = model
    assert_same_tokens(generate(model_dir, loras, 1), generate(model_dir, loras, 2), len(loras))


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens_with_an_adapter_on_the_default_model(tmp_path):
    default_dir = ensure_default_model()
    adapter = make_adapter(default_dir, tmp_path / "a", seed=41, r=8, alpha=16, strength=0.5)
    lora = [LoRARequest("a", 1, str(adapter))]
    options = dict(max_loras=1, max_cpu_loras=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert_same_tokens(generate(default_dir, lora, 1, **options), generate(default_dir, lora, 2, **options), 1)


# ---- a server on two ranks: adapters loaded and unloaded while it serves -----------------------------------


PROMPT = [5, 17, 923, 4001, 77, 311]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(Last in this file: its engine keeps this process's tensor-parallel place until the module ends.) A server
    on two ranks with one slot and one adapter in memory (each change of adapter copies it into the
    slot on both ranks, each return to one reads it again), ``first`` served from the start; the references come
    from one rank, offline."""
    model_dir = tmp_path_factory.mktemp("lora-tp-server")
    write_tiny_llama(model_dir, seed=6, hidden=96, heads=3, kv_heads=1, head_dim=32, inter=99)
    root = tmp_path_factory.mktemp("lora-tp-server-adapters")
    first = make_adapter(model_dir, root / "first", seed=51, r=8, alpha=16)
    second = make_adapter(model_dir, root / "second", seed=52, r=4, alpha=8, targets=["q_proj", "o_proj", "up_proj",
                                                                                       "down_proj"])
    # an adapter of another model: its shapes, checked whole (not against a rank's shard), do not fit
    other_dir = tmp_path_factory.mktemp("lora-tp-other-model")
    write_tiny_llama(other_dir, seed=7)
    other = make_adapter(other_dir, root / "other", seed=53, r=4, alpha=4, targets=["q_proj"])
    options = dict(dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
                   kv_cache_memory_bytes=8 << 20, cpu_threads=1, served_model_name="tiny")
    one = LLM(str(model_dir), **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    refs = {name: one.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False,
                               lora_request=lora)[0].outputs[0].text
            for name, lora in (("tiny", None), ("first", LoRARequest("first", 1, str(first))),
                               ("second", LoRARequest("second", 2, str(second))))}
    assert len(set(refs.values())) == 3, "the adapters must change the greedy text, or the tests prove nothing"
    with pytest.raises(InvalidRequestError) as refused:
        one.engine.add_lora(LoRARequest("other", 3, str(other)))
    llm = LLM(str(model_dir), tensor_parallel_size=2, lora_modules=[f"first={first}"], **options)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), allow_runtime_lora_updating=True)).start()
    try:
        yield srv, refs, {"second": second, "other": other}, str(refused.value)
    finally:
        srv.stop()
        llm.engine.shutdown()


def complete(url: str, model_name: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_adapters_loaded_and_unloaded_at_run_time_reach_both_ranks(served):
    srv, refs, paths, _ = served
    assert complete(srv.url, "first") == refs["first"]
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(paths["second"])})
        assert r.status_code == 200, r.text
        assert complete(srv.url, "second") == refs["second"]
        assert complete(srv.url, "first") == refs["first"]  # read again (one in memory), into the one slot
        assert complete(srv.url, "tiny") == refs["tiny"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            complete(srv.url, "second")
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(paths["second"])})
        assert r.status_code == 200, r.text
        assert complete(srv.url, "second") == refs["second"]


def test_a_bad_adapter_is_refused_as_on_one_rank_and_the_ranks_keep_serving(served):
    srv, refs, paths, one_rank_error = served
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(paths["other"])})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == one_rank_error
        assert "trained for another model" in one_rank_error
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "missing",
                                                           "lora_path": str(paths["other"].parent / "missing")})
        assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
    assert complete(srv.url, "tiny") == refs["tiny"]
    assert complete(srv.url, "first") == refs["first"]
