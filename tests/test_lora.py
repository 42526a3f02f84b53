"""Multi-LoRA serving offline: PEFT adapters on one base model, several adapters and base-model requests in
one ``generate`` call, each with HF transformers' greedy tokens on PEFT's merged weights as the reference.
Bad adapters are refused with what is wrong; the prefix cache never hits across adapters; the LoRA backend
contract catches a broken backend."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.execution.lora_backends import TorchLoRABackend
from pagoda.modeling.default_model import ensure_default_model
from pagoda.testing import ContractError, check_lora_backend
from lora_helpers import hf_greedy, hf_greedy_choices, make_adapter
from tiny_models import write_tiny_llama

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ---- the backend contract ----------------------------------------------------------------------


def test_the_torch_backend_meets_the_lora_backend_contract():
    check_lora_backend(TorchLoRABackend)


class OneSlotForAll(TorchLoRABackend):
    """Broken: applies the first segment's adapter to every adapter token."""

    def apply(self, y, x, lora_a, lora_b, batch):
        first = batch.segments[0][0] if batch.segments else 0
        rows = batch.lora_rows
        if rows.numel():
            y.index_add_(0, rows, (x[rows] @ lora_a[first].T) @ lora_b[first].T)


class TouchesBaseRows(TorchLoRABackend):
    """Broken: adds slot 0's term to base-model tokens too."""

    def apply(self, y, x, lora_a, lora_b, batch):
        super().apply(y, x, lora_a, lora_b, batch)
        base = torch.nonzero(batch.token_slots < 0).flatten()
        if base.numel():
            y.index_add_(0, base, (x[base] @ lora_a[0].T) @ lora_b[0].T)


@pytest.mark.parametrize("broken", [OneSlotForAll, TouchesBaseRows])
def test_a_broken_lora_backend_fails_the_contract_check(broken):
    with pytest.raises(ContractError, match="apply"):
        check_lora_backend(broken)


# ---- a tiny random model: three adapters and the base model in one call ---------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama-lora")
    write_tiny_llama(model_dir, seed=3)
    return model_dir


@pytest.fixture(scope="module")
def tiny_adapters(tiny_dir, tmp_path_factory):
    """Three adapters: every projection; attention only with rsLoRA; the MLP only at another rank."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return [
        make_adapter(tiny_dir, root / "all", seed=1, r=8, alpha=16),
        make_adapter(tiny_dir, root / "attn-rslora", seed=2, r=4, alpha=8, use_rslora=True,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
        make_adapter(tiny_dir, root / "mlp", seed=3, r=16, alpha=8, targets=["gate_proj", "up_proj", "down_proj"]),
    ]


TINY_PROMPTS = [[5, 17, 923, 4001, 77], list(range(100, 160, 3)), [42] * 9 + [1000, 2000, 3000]]


@pytest.mark.parametrize("lora_backend", ["torch", "cpu"])
def test_a_mixed_batch_gives_each_adapter_the_merged_models_greedy_tokens_on_a_tiny_model(tiny_dir, tiny_adapters,
                                                                                        lora_backend):
    # two slots for three adapters and two adapters in memory: the scheduler holds the third adapter's
    # requests back until a slot frees, and adapters are evicted and read again
    llm = LLM(str(tiny_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              kv_cache_memory_bytes=8 << 20, cpu_threads=1, max_num_batched_tokens=32, max_num_seqs=8,
              lora_backend=lora_backend)
    loras = [LoRARequest(f"tiny-{i}", i + 1, str(path)) for i, path in enumerate(tiny_adapters)]
    prompts, requests = [], []
    for p in TINY_PROMPTS:  # each prompt with the base model and each adapter, interleaved
        for lora in [None, *loras]:
            prompts.append({"prompt_token_ids": p})
            requests.append(lora)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    base_ref = hf_greedy(tiny_dir, None, TINY_PROMPTS, MAX_TOKENS)
    refs = [hf_greedy(tiny_dir, path, TINY_PROMPTS, MAX_TOKENS) for path in tiny_adapters]
    for k, p in enumerate(TINY_PROMPTS):
        row = got[k * 4:(k + 1) * 4]
        assert row[0] == base_ref[k], f"base-model prompt {k} changed beside the adapters"
        for j, ref in enumerate(refs):
            assert row[j + 1] == ref[k], f"adapter {loras[j].lora_name} diverged from HF + PEFT on prompt {k}"
    for ref in refs:  # else the comparison proves nothing
        assert ref != base_ref, "an adapter left every greedy token of the base model as it was"


# ---- the default model: two adapters and the base model --------------------------------------------


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.mark.slow
def test_a_mixed_batch_gives_each_adapter_the_merged_models_greedy_tokens_on_the_default_model(default_dir,
                                                                                                tmp_path):
    adapters = [make_adapter(default_dir, tmp_path / "a", seed=11, r=8, alpha=16, strength=0.5),
                make_adapter(default_dir, tmp_path / "b", seed=12, r=16, alpha=16, use_rslora=True, strength=0.5,
                             targets=["q_proj", "v_proj", "down_proj"])]
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory_bytes=64 << 20,
              cpu_threads=1)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def add(a, b):"]
    ids = [tok.encode(t) for t in texts]
    loras = [LoRARequest("a", 1, str(adapters[0])), LoRARequest("b", 2, str(adapters[1]))]
    prompts = [{"prompt_token_ids": p} for p in ids for _ in range(3)]
    requests = [lora for _ in ids for lora in (loras[0], None, loras[1])]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                                               lora_request=requests)]
    # [base model, adapter a, adapter b][prompt]: what pagoda gave each
    runs = [[got[3 * k + j] for k in range(len(ids))] for j in (1, 0, 2)]
    assert all(len(tokens) == MAX_TOKENS for run in runs for tokens in run)
    base_ref, *refs = (hf_greedy_choices(default_dir, path, ids, run) for path, run in zip([None, *adapters], runs))
    for k in range(len(ids)):
        assert got[3 * k + 1] == base_ref[k], f"base-model prompt {texts[k]!r} changed beside the adapters"
        assert got[3 * k] == refs[0][k], f"adapter a diverged from HF + PEFT on {texts[k]!r}"
        assert got[3 * k + 2] == refs[1][k], f"adapter b diverged from HF + PEFT on {texts[k]!r}"
    assert refs[0] != base_ref and refs[1] != base_ref, "an adapter left the greedy tokens as they were"


# ---- refusals ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               kv_cache_memory_bytes=8 << 20, cpu_threads=1)


def bad_adapter(tiny_adapters, tmp_path, name, edit):
    """A copy of the first tiny adapter with its config edited (``edit(config) -> None``) or a file removed."""
    out = tmp_path / name
    shutil.copytree(tiny_adapters[0], out)
    config = json.loads((out / "adapter_config.json").read_text())
    edit(out, config)
    if (out / "adapter_config.json").exists():
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _drop(filename):
    return lambda out, config: (out / filename).unlink()


def _set(**changes):
    return lambda out, config: config.update(changes)


@pytest.mark.parametrize("name, edit, message", [
    ("no-config", _drop("adapter_config.json"), "adapter_config.json is missing"),
    ("no-weights", _drop("adapter_model.safetensors"), "adapter_model.safetensors is missing"),
    ("dora", _set(use_dora=True), "DoRA"),
])
def test_a_broken_adapter_directory_is_refused_and_the_engine_keeps_serving(tiny_llm, tiny_adapters, tmp_path,
                                                                           name, edit, message):
    path = bad_adapter(tiny_adapters, tmp_path, name, edit)
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 50, str(path)))
    assert len(tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_an_adapter_over_the_rank_limit_is_refused_naming_the_flag(tiny_llm, tiny_adapters):
    big = LoRARequest("big", 51, str(tiny_adapters[2]))  # rank 16 > --max-lora-rank 8
    with pytest.raises(InvalidRequestError, match=r"rank 16, over this engine's --max-lora-rank 8"):
        tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=big)


def test_an_adapter_of_another_model_is_refused_with_the_shapes(tiny_llm, default_dir, tmp_path):
    other = make_adapter(default_dir, tmp_path / "other", seed=5, r=4, alpha=4, targets=["q_proj"])
    with pytest.raises(InvalidRequestError, match=r"trained for another model"):
        tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 52, str(other)))


def test_an_adapter_of_a_module_the_model_lacks_is_refused(tiny_llm, tiny_dir, tmp_path):
    head = make_adapter(tiny_dir, tmp_path / "head", seed=6, r=4, alpha=4, targets=["lm_head"])
    with pytest.raises(InvalidRequestError, match=r"adapts 'lm_head', which this model has no linear layer for"):
        tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 53, str(head)))


def test_one_id_for_two_adapters_is_refused(tiny_llm, tiny_adapters):
    tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=LoRARequest("first", 60, str(tiny_adapters[0])))
    with pytest.raises(InvalidRequestError, match="LoRA id 60 is already adapter 'first'"):
        tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("second", 60, str(tiny_adapters[1])))


def test_an_adapter_asked_of_an_engine_without_lora_is_refused(tiny_dir, tiny_adapters):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, cpu_threads=1)
    with pytest.raises(InvalidRequestError, match="LoRA is off; start the engine with enable_lora=True"):
        llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(tiny_adapters[0])))


@pytest.mark.parametrize("options, message", [
    (dict(lora_modules=["a=/x"]), "--lora-modules needs --enable-lora"),
    (dict(enable_lora=True, lora_modules=["no-path"]), "write each adapter as NAME=PATH"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "--max-cpu-loras 2 is smaller than --max-loras 4"),
    (dict(enable_lora=True, max_lora_rank=128), "max_lora_rank"),
    (dict(enable_lora=True, lora_modules=["missing=/nonexistent/adapter"]), "--lora-modules missing="),
])
def test_bad_lora_options_are_config_errors(tiny_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, cpu_threads=1, **options)


# ---- the prefix cache ------------------------------------------------------------------------------


def test_the_prefix_cache_hits_within_an_adapter_and_never_across_adapters(tiny_llm, tiny_adapters):
    prompt = {"prompt_token_ids": list(range(300, 340))}  # 40 tokens: two full blocks of 16
    a = LoRARequest("cache-a", 70, str(tiny_adapters[0]))
    b = LoRARequest("cache-b", 71, str(tiny_adapters[1]))

    def cached(lora):
        return tiny_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(a) == 32  # the same adapter: both full blocks reused
    assert cached(b) == 0  # another adapter: nothing
    assert cached(None) == 0  # the base model: nothing
    assert cached(None) == 32
