"""The conformance kit: checks a plugin component against its contract, from the plugin author's own tests::

    from pagoda.testing import check_scheduler

    def test_my_policy_meets_the_contract():
        check_scheduler(MyPolicy)

One check per component kind; each raises :class:`ContractError` saying what broke and where:

- :func:`check_scheduler` (a scheduling policy, on pagoda's scheduler) and :func:`check_kv_allocator`:
  randomised request streams (shared prefixes, ``n > 1``, aborts, a pool small enough to preempt, recompute and
  swap) through :class:`SimRunner`, a model-free runner that records which token each KV slot holds, every
  request finishing within a bounded number of steps; :func:`check_scheduler` also runs them with two steps in
  flight (:func:`check_steps_in_flight`), and holds a policy that declares an ``urgency`` to that order;
- :func:`check_attention_backend`: paged attention against dense attention on shuffled block layouts with
  odd sizes;
- :func:`check_batch_invariance`: an attention backend that claims ``batch_invariant`` gives a sequence's
  tokens the same bits alone, in chunks beside others, and after a cached prefix;
- :func:`check_sampler`: greedy rows, banned tokens, filters, the sampled distribution, seeds, logprobs;
- :func:`check_structured_output_backend`: each kind of constraint compiles; its bitmask allows the tokens of a
  matching text and the end only where it may end; refused tokens, rollback, independent matchers;
- :func:`check_architecture`: a model architecture on a tiny random checkpoint it writes, loaded through the
  plugin registry; greedy tokens and log-probabilities equal transformers' where transformers knows the name;
- :func:`check_quant_method`: quantized linear layers against their dequantized (or dense) reference;
- :func:`check_lora_backend`: every adapter of a mixed batch on its own tokens, base-model rows untouched;
- :func:`check_kv_connector`: the store keeps values whole by key from many threads, and two real engines hand
  each other prompt blocks through it with the tokens of an engine alone;
- :func:`check_proposer`: drafts that fit their slots, and greedy speculation equal to plain decoding;
- :func:`check_tool_parser`: answers read whole and streamed in any split agree, and give the calls expected;
- :func:`check_reasoning_parser`: likewise for the thinking and the answer a reasoning parser sets apart;
- :class:`StrictContracts` (the fixture ``pagoda_strict_llm``): the engine on the default model with every
  component behind a proxy that records each attribute used outside its Protocol.

Installed with pagoda, the kit is also a pytest plugin (see :mod:`pagoda.testing.pytest_plugin`).
Importing it imports torch; the checks that need a model use pagoda's default model.
"""

import importlib
from typing import Any

# name -> submodule: imported on first use, so that pagoda's pytest plugin (``pagoda.testing.pytest_plugin``,
# active in every pytest run of the environment) does not import torch for test runs that never use the kit
_EXPORTS = {
    "AttentionCase": "attention", "check_attention_backend": "attention",
    "check_architecture": "architecture",
    "check_batch_invariance": "invariance",
    "ContractError": "contract",
    "check_kv_connector": "kv_connector",
    "check_lora_backend": "lora",
    "check_proposer": "proposer",
    "check_quant_method": "quant",
    "check_sampler": "sampler",
    "check_structured_output_backend": "structured",
    "SimRunner": "scheduling", "check_kv_allocator": "scheduling", "check_scheduler": "scheduling",
    "check_steps_in_flight": "in_flight",
    "expected_output": "scheduling", "next_token": "scheduling",
    "Proxy": "strict", "StrictContracts": "strict", "contract_names": "strict",
    "ToolParserCase": "tool_parser", "check_tool_parser": "tool_parser",
    "ReasoningParserCase": "reasoning_parser", "check_reasoning_parser": "reasoning_parser",
}
__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """The kit's public checks and classes (loaded on first use), as ``dir(pagoda.testing)`` shows them."""
    return __all__


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagoda.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pagoda.testing.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
