"""How the decoder's forward pass calls its layers' modules (pagoda.modeling.models.decoder): their forwards
directly while no forward hook is set, through the modules while one is, so that hooks run as in torch; the
tokens and log-probabilities are the same either way. A tiny random Llama checkpoint in bf16 (packed linears,
fused kernels)."""

from __future__ import annotations

import random
import shutil
from collections import Counter

import pytest
import torch
import transformers
from torch.nn.modules.module import register_module_forward_hook
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from pagoda.modeling.layers.attention import Attention
from pagoda.modeling.layers.linear import Linear
from pagoda.modeling.layers.norm import RMSNorm
from pagoda.modeling.models.decoder import DecoderLayer
from one_engine import release

rng = random.Random(4)
PROMPTS = [[rng.randrange(1000, 30000) for _ in range(n)] for n in (5, 11, 17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
HOOKED = (Linear, RMSNorm, Attention, DecoderLayer)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    default_dir = ensure_default_model()
    config = transformers.LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(str(default_dir))), hidden_size=64,
                                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("layer-calls")
    model.save_pretrained(str(directory), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, directory / name)
    # no prefix cache: a prompt found cached would compute its last tokens alone, in bf16 other bits than whole
    engine = LLM(model=str(directory), dtype="bfloat16", cpu_threads=1, max_model_len=128, enable_prefix_caching=False)
    yield engine
    release(engine)
    del engine


def _generate(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def test_hooks_on_the_layers_modules_run_and_leave_the_tokens_as_they_were(llm):
    model = llm.engine.model
    plain = _generate(llm)
    assert model._call_plan.direct is True  # no hook anywhere: the modules' forwards are called directly
    calls = Counter()
    handles = []
    for module in model.layers.modules():
        if isinstance(module, HOOKED):
            handles.append(module.register_forward_pre_hook(lambda m, args: calls.update([type(m).__name__])))
    try:
        hooked = _generate(llm)
        assert model._call_plan.direct is False
    finally:
        for handle in handles:
            handle.remove()
    assert hooked == plain
    # every step ran each of the 2 layers: 4 linear layers, 2 norms and the attention layer each
    assert calls["DecoderLayer"] > 0
    assert calls["QKVParallelLinear"] == calls["ColumnParallelLinear"] == calls["Attention"] == calls["DecoderLayer"]
    assert calls["RowParallelLinear"] == calls["RMSNorm"] == 2 * calls["DecoderLayer"]
    calls.clear()
    assert _generate(llm) == plain  # the hooks removed: direct calls again, and none of the hooks runs
    assert model._call_plan.direct is True and not calls


def test_a_global_forward_hook_sees_every_linear_layer(llm):
    plain = _generate(llm)
    seen = Counter()
    handle = register_module_forward_hook(lambda m, args, out: seen.update([isinstance(m, Linear)]))
    try:
        assert _generate(llm) == plain
    finally:
        handle.remove()
    assert seen[True] > 0
    assert llm.engine.model._call_plan.direct is False
    _generate(llm)
    assert llm.engine.model._call_plan.direct is True
