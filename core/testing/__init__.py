"""The conformance kit: checks a plugin component against its contract, from the plugin author's own tests::

    from pagoda.testing import check_scheduler

    def test_my_scheduler_meets_the_contract():
        check_scheduler(MyScheduler)

One check per component kind; each raises :class:`ContractError` saying what broke and where:

- :func:`check_scheduler` and :func:`check_kv_allocator`: randomised request streams (shared prefixes,
  ``n > 1``, aborts, a pool small enough to preempt, recompute and swap) through :class:`SimRunner`, a
  model-free runner that records which token each KV slot holds;
- :func:`check_attention_backend`: paged attention against dense attention on shuffled block layouts with
  odd sizes;
- :func:`check_sampler`: greedy rows, banned tokens, filters, the sampled distribution, seeds, logprobs;
- :func:`check_quant_method`: quantized linear layers against their dequantized (or dense) reference;
- :func:`check_proposer`: drafts that fit their slots, and greedy speculation equal to plain decoding.

Installed with pagoda, the kit is also a pytest plugin (see :mod:`pagoda.testing.pytest_plugin`).
Importing it imports torch; the checks that need a model use pagoda's default model.
"""

from pagoda.testing.attention import AttentionCase, check_attention_backend
from pagoda.testing.contract import ContractError
from pagoda.testing.proposer import check_proposer
from pagoda.testing.quant import check_quant_method
from pagoda.testing.sampler import check_sampler
from pagoda.testing.scheduling import SimRunner, check_kv_allocator, check_scheduler, expected_output, next_token

__all__ = ["AttentionCase", "ContractError", "SimRunner", "check_attention_backend", "check_kv_allocator",
           "check_proposer", "check_quant_method", "check_sampler", "check_scheduler", "expected_output",
           "next_token"]
