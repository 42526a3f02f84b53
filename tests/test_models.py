"""The Llama-family model against HF transformers: greedy tokens identical, top logprobs close.

The default model (SmolLM2-135M-Instruct) runs in float32 on varied prompts; tiny random-weight
Llama, Mistral and Qwen2 checkpoints are built here with transformers, saved as safetensors and
loaded by pagoda like any checkpoint directory. HF runs with eager attention as the reference.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from one_engine import release

MAX_TOKENS = 24
NUM_TOP = 5
# float32 on both sides: log-probabilities agree far tighter than this
LOGPROB_ATOL = 2e-3

_LONG_TEXT = " ".join(
    f"Section {i}: the river town of Harwick kept {i * 7 % 13 + 2} mills, {i * 3 % 5 + 1} bridges and a "
    f"market that opened on day {i % 7 + 1} of each week, trading wool, salt and iron tools."
    for i in range(1, 19)
) + " Summarise the history of Harwick in one paragraph:"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: The weather is nice today.",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Hi",
    _LONG_TEXT,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Japan? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
]


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def llm(default_dir):
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=96 << 20, cpu_threads=1)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm


@pytest.fixture(scope="module")
def hf_model(default_dir):
    model = AutoModelForCausalLM.from_pretrained(str(default_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy choice after the prompt and each prefix of ``token_ids``, and the log-softmax of its raw logits
    there, ``[steps, vocab]``, from one forward pass over the prompt and the tokens (teacher forcing). Where each
    choice equals the token it precedes, the tokens are HF's greedy continuation: a step-by-step ``generate`` would
    make the same choices one at a time, at some 20 times the cost (one forward pass per token)."""
    ids = prompt_ids + token_ids[:-1]
    with torch.inference_mode():
        # the logits of the prompt's last position and after it only: [len(token_ids), vocab]
        logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       logits_to_keep=len(token_ids)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.argmax(dim=-1).tolist(), logprobs


def assert_ends_at_the_limit_or_eos(completion, max_tokens: int, model) -> None:
    """A completion HF's greedy choices are checked along (:func:`hf_greedy`) ran as far as HF's own ``generate``
    would: to ``max_tokens``, or to an end-of-sequence token of the model's generation config."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    if len(completion.token_ids) < max_tokens:
        assert completion.token_ids[-1] in eos_ids, (completion.token_ids, eos_ids)


def assert_top_logprobs_close(completion, hf_logprobs: torch.Tensor) -> None:
    """Each step's top-NUM_TOP pagoda logprobs equal HF's log-softmax at the same token ids."""
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token_id, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert token_id in top, f"step {step}: the sampled token is missing from its own logprobs"
        assert len(top) == NUM_TOP  # greedy: the sampled token is the top-1, so no extra entry
        ref_row = hf_logprobs[step]
        for tid, lp in top.items():
            assert abs(lp.logprob - float(ref_row[tid])) < LOGPROB_ATOL, (step, tid, lp.logprob, float(ref_row[tid]))
        ref_top = ref_row.topk(NUM_TOP)
        # the 5th and 6th candidates can be near-tied; compare ids only where HF separates them clearly
        margin = float(ref_top.values[-1] - ref_row.topk(NUM_TOP + 1).values[-1])
        if margin > LOGPROB_ATOL:
            assert set(top) == set(ref_top.indices.tolist()), step
        ranks = sorted(top.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranks] == list(range(1, NUM_TOP + 1))


@pytest.mark.slow
def test_default_model_greedy_tokens_match_hf_on_varied_prompts(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=NUM_TOP)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(tok.encode(_LONG_TEXT)) > 450  # the long prompt really is long
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok(prompt).input_ids
        completion = out.outputs[0]
        ref_ids, ref_logprobs = hf_greedy(hf_model, out.prompt_token_ids, completion.token_ids)
        assert completion.token_ids == ref_ids, f"prompt {prompt[:40]!r} diverged from HF"
        assert_ends_at_the_limit_or_eos(completion, MAX_TOKENS, hf_model)
        assert_top_logprobs_close(completion, ref_logprobs)


def test_default_model_chat_answers_match_hf_with_the_chat_template(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=NUM_TOP)
    outputs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    for messages, out in zip(CONVERSATIONS, outputs):
        expected_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected_prompt = list(getattr(expected_prompt, "input_ids", None) or expected_prompt)
        assert out.prompt_token_ids == expected_prompt
        completion = out.outputs[0]
        ref_ids, ref_logprobs = hf_greedy(hf_model, expected_prompt, completion.token_ids)
        assert completion.token_ids == ref_ids
        assert_ends_at_the_limit_or_eos(completion, 40, hf_model)
        assert_top_logprobs_close(completion, ref_logprobs)
        assert completion.text.strip()


def test_default_model_prompt_logprobs_match_hf_forward_pass(llm, hf_model):
    prompt = "The quick brown fox jumps over the lazy dog because"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]
    assert out.prompt_logprobs[0] is None  # the first prompt token has no context
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(ref[pos - 1, tid])) < LOGPROB_ATOL


# ---- tiny random-weight checkpoints ------------------------------------------------------------

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)


def _tiny_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, **TINY)
    if arch == "mistral":
        # a window as long as the context (pagoda accepts it because it never slides), one KV head
        # and a head_dim that is not hidden_size / num_heads
        shape = dict(TINY, num_key_value_heads=1, head_dim=32)
        return MistralConfig(vocab_size=vocab_size, sliding_window=512, **shape)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, rope_theta=1_000_000.0, **TINY)
    raise ValueError(arch)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny_checkpoint(request, tmp_path_factory, default_dir):
    """(directory, HF model) of a random-weight checkpoint using the default model's tokenizer."""
    from transformers import AutoTokenizer

    arch = request.param
    tokenizer = AutoTokenizer.from_pretrained(str(default_dir))
    torch.manual_seed(1234)
    hf_cfg = _tiny_config(arch, len(tokenizer))
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager").eval()
    if arch == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    out_dir = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_dir / name).exists():
            shutil.copy(default_dir / name, out_dir / name)
    model.generation_config.eos_token_id = None
    return arch, out_dir, model


def test_tiny_random_checkpoints_match_hf_greedy_tokens_and_logprobs(tiny_checkpoint, request):
    arch, ckpt_dir, hf = tiny_checkpoint
    assert list((ckpt_dir).glob("*.safetensors"))
    llm = LLM(model=str(ckpt_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=8 << 20,
              cpu_threads=1)
    request.addfinalizer(lambda: release(llm))
    assert llm.engine.config.model.architecture.lower().startswith(arch)
    prompts = [
        {"prompt_token_ids": [5, 17, 923, 4001, 77]},
        {"prompt_token_ids": list(range(100, 400, 3))},  # 100 tokens: several KV blocks
        "A tiny model still has to agree with its reference.",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=NUM_TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        ref_ids, ref_logprobs = hf_greedy(hf, out.prompt_token_ids, completion.token_ids)
        assert len(completion.token_ids) == 20
        assert completion.token_ids == ref_ids, f"{arch}: prompt of {len(out.prompt_token_ids)} tokens diverged"
        assert_top_logprobs_close(completion, ref_logprobs)
    windows = {layer.attn.sliding_window for layer in llm.engine.model.layers}
    if arch == "mistral":
        # its 512-token window covers the engine's whole 512-token length: no layer needs the windowed path
        assert windows == {None}


def test_a_window_shorter_than_the_engines_length_stays(tmp_path):
    from tiny_models import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for max_model_len, window in ((64, None), (128, 64)):
        llm = LLM(model=str(tmp_path), load_format="dummy", max_model_len=max_model_len,
                  kv_cache_memory_bytes=2 << 20, cpu_threads=1)
        assert {layer.attn.sliding_window for layer in llm.engine.model.layers} == {window}
        llm.engine.shutdown()
