"""``--logprobs-mode``: what a sampled token's logprobs hold, with vLLM's four names, on one tiny Llama."""
import math

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.sampling.sampler import REMOVED_TOKEN_LOGPROB
from tiny_models import write_tiny_llama

PROMPT = [5, 17, 301, 42, 9, 1200, 77]
TOP = 6  # top logprobs asked for: more than top_k keeps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3, norm_noise=0.5)


def _steps(model_dir, mode, params):
    llm = LLM(model=str(model_dir), logprobs_mode=mode, kv_cache_memory_bytes=2 << 20, cpu_threads=1, seed=0)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    finally:
        llm.engine.shutdown()
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


@pytest.fixture(scope="module")
def raw(model_dir):
    """Greedy steps with the raw logits and the raw logprobs of each."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=TOP)
    tokens, logits = _steps(model_dir, "raw_logits", params)
    same_tokens, logprobs = _steps(model_dir, "raw_logprobs", params)
    assert tokens == same_tokens
    return tokens, logits, logprobs


def test_raw_logits_are_the_logprobs_before_their_normalisation(raw):
    tokens, logits, logprobs = raw
    for token, step_logits, step_logprobs in zip(tokens, logits, logprobs):
        assert set(step_logits) == set(step_logprobs) and max(step_logits, key=step_logits.get) == token
        # a log-softmax shifts every logit of a row by one constant, and the row's probabilities sum to at most 1
        shifts = [step_logits[t] - step_logprobs[t] for t in step_logits]
        assert max(shifts) - min(shifts) < 1e-4 and min(shifts) > max(step_logits.values()) - 1e-4
        assert sum(math.exp(v) for v in step_logprobs.values()) < 1.0


def test_processed_values_are_the_filtered_tempered_distribution_the_token_came_from(model_dir, raw):
    _, raw_logits, _ = raw
    params = SamplingParams(max_tokens=1, temperature=0.5, top_k=3, logprobs=TOP, seed=11)
    (token,), (logits,) = _steps(model_dir, "processed_logits", params)
    (same,), (logprobs,) = _steps(model_dir, "processed_logprobs", params)
    assert token == same
    first = raw_logits[0]
    kept = sorted(first, key=first.get, reverse=True)[:3]
    assert token in kept
    for t in kept:
        assert logits[t] == pytest.approx(first[t] / 0.5, abs=1e-4)
    # the top_k's leftovers: the asked-for count is filled with a finite stand-in for -inf
    assert sorted(v for t, v in logits.items() if t not in kept) == [REMOVED_TOKEN_LOGPROB] * (TOP - 3)
    assert sum(math.exp(logprobs[t]) for t in kept) == pytest.approx(1.0, abs=1e-5)
    expected = torch.log_softmax(torch.tensor([first[t] / 0.5 for t in kept]), dim=0)
    assert [logprobs[t] for t in kept] == pytest.approx(expected.tolist(), abs=1e-4)


def test_processed_logits_of_a_greedy_request_carry_its_bias(model_dir, raw):
    tokens, raw_logits, _ = raw
    loser = sorted(raw_logits[0], key=raw_logits[0].get)[0]  # the least likely of the raw top tokens
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, logit_bias={loser: 50.0})
    (token,), (logits,) = _steps(model_dir, "processed_logits", params)
    assert token == loser and logits[loser] == pytest.approx(raw_logits[0][loser] + 50.0, abs=1e-4)
    assert logits[tokens[0]] == pytest.approx(raw_logits[0][tokens[0]], abs=1e-4)


def test_an_unknown_mode_is_refused_naming_the_choices(model_dir):
    from pagoda.errors import ConfigError

    with pytest.raises(ConfigError, match="logprobs_mode.*raw_logprobs"):
        LLM(model=str(model_dir), logprobs_mode="processed", kv_cache_memory_bytes=2 << 20, cpu_threads=1)


def test_a_served_model_gives_processed_logprobs_through_the_openai_client(model_dir):
    import openai

    from pagoda.cli import build_parser, engine_args_from
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.server import ServerThread, build_app

    ns = build_parser().parse_args(["serve", str(model_dir), "--logprobs-mode", "processed_logprobs",
                                    "--kv-cache-memory-bytes", str(2 << 20), "--cpu-threads", "1"])
    args = engine_args_from(ns, model=str(model_dir))
    assert args.logprobs_mode == "processed_logprobs"
    server = ServerThread(build_app(AsyncLLMEngine(LLMEngine.from_engine_args(args)))).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        choice = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=3, temperature=0.8,
                                           logprobs=4, seed=5, extra_body={"top_k": 2}).choices[0]
    finally:
        server.stop()
    for top in choice.logprobs.top_logprobs:
        values = sorted(top.values(), reverse=True)
        assert values[2:] == [REMOVED_TOKEN_LOGPROB] * 2  # top_k 2 keeps two tokens: they hold all the mass
        assert math.exp(values[0]) + math.exp(values[1]) == pytest.approx(1.0, abs=1e-4)
