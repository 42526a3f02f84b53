"""Two engines in one process keep their own host settings: each model runs the kernels its engine chose, and a
second engine asking for a different process-wide setting is warned about, not silently applied."""

import logging
import sys

import pytest
import torch

from pagoda.engine.llm import LLM
from pagoda.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, ignore_eos=True)
OPTIONS = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=32 << 20, cpu_threads=1)


def _generate(llm: LLM) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of PROMPTS, and the C++ extension modules whose functions the request called."""
    extensions: set[str] = set()

    def profile(frame, event, arg):
        if event == "c_call":
            module = getattr(arg, "__module__", None) or ""
            if module.startswith("pagoda_cpu_"):
                extensions.add(module)

    sys.setprofile(profile)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return [list(o.outputs[0].token_ids) for o in outputs], extensions


def _uses(extensions: set[str], kernel: str) -> bool:
    return any(name.startswith(kernel) for name in extensions)


def test_two_engines_with_different_kernel_settings_each_run_their_own():
    fused = LLM(**OPTIONS)  # the defaults: fused CPU ops and the prefill kernel on
    if fused.engine.model.kernels.ops is None or fused.engine.backend.prefill_kernel is None:
        pytest.skip("the C++ kernels cannot be built here")
    fused_tokens, fused_extensions = _generate(fused)
    assert _uses(fused_extensions, "pagoda_cpu_ops") and _uses(fused_extensions, "pagoda_cpu_prefill")

    plain = LLM(**OPTIONS, fused_cpu_ops=False, cpu_prefill_kernel=False)
    plain_tokens, plain_extensions = _generate(plain)
    assert not _uses(plain_extensions, "pagoda_cpu_ops") and not _uses(plain_extensions, "pagoda_cpu_prefill")
    assert plain.engine.model.kernels.isa_paths(torch.bfloat16)["rmsnorm/silu/rope"] == "torch"
    assert plain.engine.backend.isa_paths()["prefill attention"] == "sdpa"

    # the first engine, after the second was built and ran: still its own kernels, still its own tokens
    again_tokens, again_extensions = _generate(fused)
    assert _uses(again_extensions, "pagoda_cpu_ops") and _uses(again_extensions, "pagoda_cpu_prefill")
    assert fused.engine.model.kernels.isa_paths(torch.bfloat16)["rmsnorm/silu/rope"] != "torch"
    assert fused.engine.backend.isa_paths()["prefill attention"] != "sdpa"
    assert again_tokens == fused_tokens
    assert _generate(plain)[0] == plain_tokens


def test_a_second_engine_asking_for_another_thread_count_is_warned_about(caplog):
    first = LLM(**OPTIONS)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        second = LLM(**{**OPTIONS, "cpu_threads": 2})
    assert ("cpu_threads=2 differs from the 1 compute threads of an engine already running in this process"
            in caplog.text)
    assert first.engine.num_threads == 1 and second.engine.num_threads == 2 == torch.get_num_threads()
