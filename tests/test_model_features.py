"""The architectures beyond Llama with the engine's other features: speculative decoding with a draft of the same
family (a tiny random one-layer checkpoint of the same config class and vocabulary), structured outputs (alone
and under speculation), the KV offload tier (on four architectures) and two pipeline stages (on three). Each gives
the plain engine's greedy tokens on the same checkpoint (float32); the plain engine's tokens are transformers'
(test_model_composition.py)."""

from __future__ import annotations

import random
import re
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.modeling.default_model import ensure_default_model
from one_engine import release
from test_model_composition import _config as dense_config
from tiny_models import default_vocab_size

ARCHITECTURES = ["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3", "phi3", "mixtral"]
# pipeline stages on the architectures whose first or last stage differs: Gemma's embedding scale on the first
# stage and soft-capped logits on the last, Phi-3's tied embedding on both ends, Mixtral's experts (each stage
# process is a model of its own: 15-20 s a run on a busy 2-core machine)
PIPELINE_ARCHITECTURES = ["gemma2", "phi3", "mixtral"]
# the offload tier copies KV blocks, whose shape is all an architecture changes: head sizes of 32, 24 (Gemma 2's
# one KV head), 16 (Phi-3) and Mixtral's
OFFLOAD_ARCHITECTURES = ["qwen3", "gemma2", "phi3", "mixtral"]
rng = random.Random(11)
# four 48-token prefixes (3 blocks of 16) with distinct tails, twice: a 12-block pool cannot keep all four, so the
# second pass finds its prefixes in the RAM tier
PREFIXES = [[rng.randrange(1000, 30000) for _ in range(48)] for _ in range(4)]
PROMPTS = [p + [rng.randrange(1000, 30000) for _ in range(5)] for p in PREFIXES] * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
STRUCTURED = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=DATE))
BASE = dict(dtype="float32", max_model_len=128, cpu_threads=1, block_size=16)
SMALL_POOL = dict(num_gpu_blocks_override=12, max_num_seqs=2)


def _config(arch: str, vocab: int, layers: int):
    if arch == "mixtral":  # top-2 of 4 experts, odd expert size
        config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=37,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                            initializer_range=0.2)
    else:
        config = dense_config(arch, vocab)
    config.num_hidden_layers = layers
    for field in ("layer_types", "no_rope_layers"):  # one entry per layer
        if getattr(config, field, None) is not None:
            setattr(config, field, list(getattr(config, field))[:layers])
    return config


def _write(arch: str, directory, layers: int, seed: int, vocab: int, default_dir) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, vocab, layers), dtype=torch.float32)
    for p in model.parameters():  # norms off 1 (Gemma's 1 + w) and q/k norms that matter
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(str(directory), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, directory / name)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(request, tmp_path_factory):
    """(architecture, target directory, draft directory, the plain engine's greedy and structured tokens)."""
    arch, default_dir = request.param, ensure_default_model()
    vocab = default_vocab_size()
    target = _write(arch, tmp_path_factory.mktemp(f"target-{arch}"), 2, 5, vocab, default_dir)
    draft = _write(arch, tmp_path_factory.mktemp(f"draft-{arch}"), 1, 6, vocab, default_dir)
    plain = LLM(model=target, **BASE, **SMALL_POOL)
    try:
        expected = _generate(plain), _structured(plain)
    finally:
        release(plain)  # its grammar compiler's process too; one engine alive at a time
        del plain
    return arch, target, draft, expected


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _structured(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], STRUCTURED, use_tqdm=False)
    for out in outs:
        assert re.fullmatch(DATE, out.outputs[0].text), out.outputs[0].text
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("checkpoints", ARCHITECTURES, indirect=True)
def test_a_draft_of_the_same_family_keeps_the_greedy_and_structured_tokens(checkpoints):
    arch, target, draft, (greedy, structured) = checkpoints
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm = LLM(model=target, speculative_config=spec, **BASE, **SMALL_POOL)
    try:
        assert _generate(llm) == greedy, f"{arch}: speculative greedy tokens"
        assert _structured(llm) == structured, f"{arch}: speculative structured tokens"
        assert llm.engine.spec_stats.num_draft_tokens > 0
    finally:
        release(llm)


@pytest.mark.parametrize("checkpoints", OFFLOAD_ARCHITECTURES, indirect=True)
def test_the_ram_offload_tier_keeps_the_tokens_and_gives_hits(checkpoints):
    arch, target, _, (greedy, _) = checkpoints
    llm = LLM(model=target, kv_offload_ram=0.0005, enable_prefix_caching=True, **BASE, **SMALL_POOL)
    try:
        assert _generate(llm) == greedy, f"{arch}: tokens with the offload tier"
        assert llm.engine.kv_manager.tiers.stats.ram.hits > 0, f"{arch}: the second pass should load from RAM"
    finally:
        release(llm)


@pytest.mark.parametrize("checkpoints", PIPELINE_ARCHITECTURES, indirect=True)
def test_two_pipeline_stages_keep_the_tokens(checkpoints):
    arch, target, _, (greedy, _) = checkpoints
    llm = LLM(model=target, pipeline_parallel_size=2, swap_space=0, **BASE, **SMALL_POOL)
    try:
        assert _generate(llm) == greedy, f"{arch} over 2 pipeline stages"
    finally:
        release(llm)
