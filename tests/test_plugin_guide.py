"""Every example of docs/plugins.md, run as printed: each is installed as its own distribution with a
``pagoda.plugins`` entry point (a dist-info directory on sys.path, what pip would leave), loaded the way
any plugin is, selected by name, and checked by the conformance call the guide names for it."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.errors import CheckpointError, ConfigError, InvalidRequestError
from pagoda.scheduling import SchedulingPolicy
from pagoda.registry.plugin_manager import PluginManager
from pagoda.testing import (StrictContracts, ToolParserCase, check_attention_backend, check_kv_allocator, check_proposer,
                            check_quant_method, check_sampler, check_scheduler, check_structured_output_backend,
                            check_tool_parser)
from one_engine import release
from tiny_models import write_tiny_llama

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
KINDS = ["scheduler", "KV allocator", "KV allocator eviction", "attention backend", "wrapping attention backend",
         "sampler", "structured-output backend", "quantization method", "speculative proposer", "model loader",
         "model architecture", "tool-call parser", "CLI command"]


def guide_examples() -> dict[str, str]:
    """``{kind: source}`` of the python blocks that start with ``# example: <kind>``."""
    blocks = re.findall(r"```python\n(# example: ([^\n]+)\n.*?)```", GUIDE.read_text(), flags=re.S)
    return {kind: source for source, kind in blocks}


def module_name(kind: str) -> str:
    return "guide_" + re.sub(r"\W+", "_", kind.lower())


def test_the_guide_has_one_short_complete_example_per_component_kind():
    examples = guide_examples()
    assert sorted(examples) == sorted(KINDS)
    for kind, source in examples.items():
        assert len(source.splitlines()) <= 50, f"the {kind} example has {len(source.splitlines())} lines"
        assert "@pagoda.hookimpl" in source and "PAGODA_PLUGIN_API" in source
        assert not re.search(r"\._[a-z]", source), f"the {kind} example uses a private name"


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """Each example as an installed distribution; yields ``{kind: module}``."""
    site = tmp_path_factory.mktemp("guide-site")
    for kind, source in guide_examples().items():
        name = module_name(kind)
        (site / f"{name}.py").write_text(source)
        dist = site / f"{name}-1.0.dist-info"  # the name before the first '-' is the distribution's
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(f"[pagoda.plugins]\n{name} = {name}\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield {kind: importlib.import_module(module_name(kind)) for kind in KINDS}
    finally:
        sys.path.remove(str(site))
        for kind in KINDS:
            sys.modules.pop(module_name(kind), None)
        importlib.invalidate_caches()


def test_every_example_loads_through_its_entry_point(guide):
    pm = PluginManager().load()
    assert not pm.failures, [f.error for f in pm.failures]
    for name, hook in [("shortest-output-first", "pagoda_schedulers"), ("watermark", "pagoda_kv_allocators"),
                       ("gather", "pagoda_attention_backends"), ("no-repeat-3gram", "pagoda_samplers"),
                       ("int8-weight-only", "pagoda_quant_methods"), ("bigram", "pagoda_proposers"),
                       ("verified-safetensors", "pagoda_model_loaders"),
                       ("SoftcapLlamaForCausalLM", "pagoda_model_architectures"),
                       ("count-tokens", "pagoda_cli_commands")]:
        component = pm.get(hook, name, "test")
        assert component.dist.endswith(" 1.0") and pm.api_ranges[component.plugin] == ">=0.10,<0.11"
    for name, hook in [("lfu", "pagoda_kv_allocators"), ("timed-torch", "pagoda_attention_backends")]:
        assert pm.api_ranges[pm.get(hook, name, "test").plugin] == ">=0.10,<0.11"
    assert pm.api_ranges[pm.get("pagoda_tool_parsers", "mistral", "test").plugin] == ">=0.10,<0.11"


OPTIONS = dict(dtype="float32", max_model_len=512, cpu_threads=1, kv_cache_memory_bytes=32 << 20)
PROMPTS = ["The capital of France is", "one two three four one two three four one two", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """OPTIONS on a two-layer random Llama in real safetensors files with the default model's tokenizer: what the
    examples' engines check is the plugin's mechanism, not the model's answers (the sampler's test, which needs
    the default model's habit of repeating itself, runs on the default model)."""
    return dict(OPTIONS, model=str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def build():
    """``build(**options)`` is ``LLM(**options)``; every engine a test built is shut down and freed when the test
    ends, so the module holds one at a time and leaves none behind in the worker."""
    built: list[LLM] = []

    def make(**options) -> LLM:
        built.append(LLM(**options))
        return built[-1]

    yield make
    while built:
        release(built.pop())


def tokens_of(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tokens(guide, tiny):
    llm = LLM(**tiny)
    try:
        return tokens_of(llm)
    finally:
        release(llm)


def test_the_scheduler_example(guide, tiny, build):
    policy = guide["scheduler"].ShortestOutputFirst
    check_scheduler(policy)
    llm = build(**{**tiny, "max_num_seqs": 1}, scheduling_policy="shortest-output-first")
    engine, finished = llm.engine, []
    engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("short", PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["short", "long"]


def test_the_kv_allocator_example(guide, plain_tokens, tiny, build):
    allocator = guide["KV allocator"].WatermarkAllocator
    check_kv_allocator(allocator)
    check_scheduler(SchedulingPolicy, allocator=allocator)
    llm = build(**tiny, kv_allocator="watermark")
    assert isinstance(llm.engine.kv_manager, allocator)
    assert tokens_of(llm) == plain_tokens


def test_the_eviction_example_keeps_the_most_reused_prefix(guide, plain_tokens, tiny, build):
    from pagoda.config import CacheConfig
    from pagoda.sampling_params import SamplingParams as Params
    from pagoda.sequence import Sequence

    allocator = guide["KV allocator eviction"].LeastFrequentlyUsedAllocator
    check_kv_allocator(allocator)
    kv = allocator(CacheConfig(4, 0, "auto", True, 6, 0, "recompute", "lfu"), 6)

    def run(rid, tokens):
        seq = Sequence(rid, list(tokens), Params(max_tokens=1))
        blocks, cached = kv.get_computed_blocks(seq)
        assert kv.allocate_slots(seq, len(tokens) - cached, blocks)
        return seq, cached

    shared, _ = run("shared", range(100, 109))
    kv.free(shared)
    for i in range(3):
        again, cached = run(f"again{i}", range(100, 109))
        assert cached == 8
        kv.free(again)
    once, _ = run("once", range(200, 209))
    kv.free(once)  # the least recently freed block is the shared prefix's: LRU would overwrite it first
    run("new", range(300, 312))
    assert kv.get_computed_blocks(Sequence("s", list(range(100, 109)), Params()))[1] == 8
    assert kv.get_computed_blocks(Sequence("o", list(range(200, 209)), Params()))[1] < 8
    assert tokens_of(build(**tiny, kv_allocator="lfu")) == plain_tokens


def test_the_wrapping_example_runs_the_built_in_it_wraps(guide, plain_tokens, tiny, build):
    from pagoda.plugins.attention.torch_backend import TorchAttentionBackend

    pm = PluginManager().load()
    timed_torch = pm.factory("pagoda_attention_backends", "timed-torch")
    check_attention_backend(timed_torch)
    llm = build(**tiny, attention_backend="timed-torch")
    assert tokens_of(llm) == plain_tokens
    backend = llm.engine.runner.backend
    assert isinstance(backend.inner, TorchAttentionBackend) and backend.seconds > 0
    # under strict contracts too: pagoda setting the optional isa_paths on the wrapper is not the plugin's doing
    strict = StrictContracts()
    strict_llm = strict.llm(**tiny, attention_backend="timed-torch")
    try:
        strict_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        release(strict_llm)
    strict.assert_clean()


def test_the_attention_backend_example(guide, plain_tokens, tiny, build):
    check_attention_backend(guide["attention backend"].GatherAttention)
    assert tokens_of(build(**tiny, attention_backend="gather")) == plain_tokens


def test_the_sampler_example(guide, tiny):
    sampler = guide["sampler"].NoRepeatNgramSampler
    check_sampler(sampler)
    # the default model, whose plain greedy decoding repeats the counting of PROMPTS[1]; one copy at a time
    outputs = {}
    for name, options in (("no-repeat-3gram", dict(sampler="no-repeat-3gram")), ("plain", {})):
        llm = LLM(**OPTIONS, **options)
        try:
            outputs[name] = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            prompt_ids = llm.engine.tokenize_prompt(PROMPTS[1])[1]
        finally:
            release(llm)
            del llm
    tokens = prompt_ids + outputs["no-repeat-3gram"]
    trigrams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    new = trigrams[len(prompt_ids) - 2:]  # the trigrams each output token completed
    assert all(t not in trigrams[:len(prompt_ids) - 2 + j] for j, t in enumerate(new))
    assert outputs["no-repeat-3gram"] != outputs["plain"]  # plain greedy decoding repeats the counting
    with pytest.raises(ConfigError, match="does not sample the standard distribution"):
        LLM(**tiny, sampler="no-repeat-3gram", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_structured_output_backend_example(guide, tiny, build):
    pm = PluginManager().load()
    assert pm.api_ranges[pm.get("pagoda_structured_output_backends", "small", "test").plugin] == ">=0.10,<0.11"
    check_structured_output_backend(pm.factory("pagoda_structured_output_backends", "small"))
    llm = build(**tiny, structured_outputs_backend="small")
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["Paris", "Rome"]))
    assert llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text in ("Paris", "Rome")
    assert llm.engine.structured_outputs.compiled(params.structured_outputs).backend_name == "small"
    huge = StructuredOutputsParams(choice=["x" * 3000], backend="small")
    with pytest.raises(InvalidRequestError, match="more than 2000"):
        llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=huge), use_tqdm=False)


def test_the_quantization_example(guide, plain_tokens, tiny, build):
    config = guide["quantization method"].Int8WeightOnlyConfig
    check_quant_method(config)
    check_quant_method(config, {"skip_layers": ["model.layers.0.self_attn.o_proj"]})
    llm = build(**tiny, quantization="int8-weight-only")
    layer = llm.engine.runner.model.layers[0].o_proj
    assert layer.qweight.dtype == torch.int8 and not hasattr(layer, "weight")
    outputs = tokens_of(llm)
    # int8 weights round every product: the first tokens agree with float32
    assert all(a[:3] == b[:3] for a, b in zip(outputs, plain_tokens))


def test_the_proposer_example(guide, tiny):
    # the kit's engines (plain and speculative, greedy tokens compared) on the tiny model, not two default-model ones
    check_proposer(guide["speculative proposer"].BigramLookup, model=tiny["model"])


def test_the_loader_example(guide, tmp_path, build):
    import hashlib

    write_tiny_llama(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    (tmp_path / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
                                                 for f in files))
    options = dict(OPTIONS, model=str(tmp_path))
    assert tokens_of(build(**options, load_format="verified-safetensors")) == tokens_of(build(**options))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{files[0].name} has SHA-256 .* download it again"):
        LLM(**options, load_format="verified-safetensors")


def test_the_architecture_example(guide, tmp_path, build):
    import json
    import math

    from pagoda.modeling.models.llama import LlamaForCausalLM

    write_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["SoftcapLlamaForCausalLM"], final_logit_softcapping=2.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = build(**OPTIONS, model=str(tmp_path))
    model = llm.engine.runner.model
    assert type(model).__name__ == "SoftcapLlamaForCausalLM"
    hidden = torch.randn(3, config["hidden_size"])
    plain = LlamaForCausalLM.compute_logits(model, hidden)
    torch.testing.assert_close(model.compute_logits(hidden), 2.0 * torch.tanh(plain / 2.0))
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=1), use_tqdm=False)[0]
    # capped logits lie in [-2, 2]: no token is likelier than e^4 times another, which bounds the top one
    bound = math.log(math.exp(4) / (math.exp(4) + config["vocab_size"] - 1))
    top = [max(entry.logprob for entry in lp.values()) for lp in out.outputs[0].logprobs]
    assert all(v <= bound + 1e-4 for v in top) and len(top) == 3


def test_the_tool_call_parser_example(guide):
    parser = guide["tool-call parser"].MistralToolParser
    check_tool_parser(parser, [
        ToolParserCase('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', None, [("add", {"a": 1})]),
        ToolParserCase('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add"}]', None,
                       [("get_weather", {"city": "Paris"}), ("add", {})]),
        ToolParserCase("[TOOL_CALLS] not JSON", "[TOOL_CALLS] not JSON"),
        ToolParserCase("[TOOL", "[TOOL"),
    ])


def test_the_cli_example(guide, capsys):
    from pagoda.cli import main

    assert main(["count-tokens", "Hello there"]) == 0
    count = int(capsys.readouterr().out.strip())
    from transformers import AutoTokenizer

    from pagoda.modeling.default_model import ensure_default_model

    assert count == len(AutoTokenizer.from_pretrained(str(ensure_default_model()))("Hello there")["input_ids"])


def test_every_path_and_module_the_guide_names_exists():
    """Backticked file paths (pagoda's own, as in its source tree: core/, plugins/, contrib/, tests/, docs/)
    and dotted pagoda names (modules, or attributes of one) in the guide all resolve."""
    root = GUIDE.parent.parent
    text = GUIDE.read_text()
    paths = set(re.findall(r"`((?:core|plugins|contrib|tests|docs)/[\w./-]+)`", text))
    assert {"core/hookspecs.py", "contrib/pagoda-sjf/tests/test_contract.py"} <= paths
    assert [p for p in sorted(paths) if not (root / p).exists()] == []
    assert not re.search(r"`pagoda/\w+\.py`", text), "name files by their source path (core/...) or module name"
    missing = []
    for dotted in sorted(set(re.findall(r"`(pagoda(?:\.\w+)+)`", text))):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    assert missing == []
