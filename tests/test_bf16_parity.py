"""bf16 greedy tokens against float32 on the parity prompts of test_models.py, natively and capped to AVX2.

``dtype auto`` is bf16 on AVX2 CPUs too (fp32 math inside the kernels), so the README states where its
tokens differ from float32's. This test holds it to that: on the 8 prompts (24 tokens) and 2 chats (40
tokens), bf16 gives float32's tokens on all but one prompt, and the AVX2 path gives the tokens of the
native one. The AVX2 run is a subprocess: a kernel is built once per process, at the level then in effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagoda import LLM, SamplingParams
from pagoda.cpu_isa import cpu_isa
from test_models import CONVERSATIONS, MAX_TOKENS, PROMPTS

# bf16 rounding of the activations changes this prompt's 6th greedy token (README, "CPU ISA levels")
DIFFERS_IN_BF16 = {"Once upon a time, in a small village by the sea,"}

_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from pagoda import LLM
from test_bf16_parity import parity_tokens
print(json.dumps(parity_tokens(LLM(dtype={dtype!r}, max_model_len=1024, kv_cache_memory_bytes=96 << 20,
                                   cpu_threads=1))))
"""


def parity_tokens(llm: LLM) -> list[list[int]]:
    """The greedy tokens of every parity prompt, then every chat."""
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    chats = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    return [o.outputs[0].token_ids for o in plain + chats]


def greedy_tokens(dtype: str, **env: str) -> list[list[int]]:
    """:func:`parity_tokens` in a fresh process with ``env`` added."""
    code = _RUN.format(tests=os.path.dirname(__file__), dtype=dtype)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def float32_tokens() -> list[list[int]]:
    return parity_tokens(LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=96 << 20, cpu_threads=1))


def assert_float32_tokens_but_documented(bf16: list[list[int]], float32: list[list[int]], what: str) -> None:
    names = PROMPTS + [c[-1]["content"] for c in CONVERSATIONS]
    differ = {name for name, a, b in zip(names, bf16, float32) if a != b}
    assert differ == DIFFERS_IN_BF16, f"{what}: bf16 tokens differ from float32's on {sorted(differ)}"


@pytest.mark.slow
def test_bf16_on_avx2_gives_the_native_bf16_tokens_and_float32_s_but_where_documented(float32_tokens):
    if cpu_isa() == "generic":
        pytest.skip("this CPU has no AVX2")
    avx2 = greedy_tokens("bfloat16", PAGODA_CPU_ISA="avx2")
    assert_float32_tokens_but_documented(avx2, float32_tokens, "AVX2")
    if cpu_isa() != "avx2":  # a bigger CPU: its own bf16 path gives the same tokens
        native = greedy_tokens("bfloat16")
        assert native == avx2, "bf16 tokens differ between the native and the AVX2 path"
