"""Engine configuration: the frozen configs the engine and its plugins read.

They are built from the flat options of :class:`pagoda.engine.engine_args.EngineArgs` (the CLI flags,
``pagoda.EngineArgs``). This module also exports the dtype helpers of :mod:`pagoda.host.dtypes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagoda.host.dtypes import (FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPE_CHOICES, cpu_has_bf16, cpu_runs_bf16_fast,
                                is_fp8_kv_cache, resolve_dtype, resolve_kv_cache_dtype)
from pagoda.host.env import HostConfig, resolve_host_config
from pagoda.sampling_params import MAX_LOGPROBS

__all__ = [
    "GiB", "ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "SpeculativeConfig", "LoRAConfig",
    "EngineConfig",
    "FP8_KV_CACHE_DTYPES", "KV_CACHE_DTYPE_CHOICES", "cpu_has_bf16", "cpu_runs_bf16_fast", "is_fp8_kv_cache",
    "resolve_dtype", "resolve_kv_cache_dtype",
]

GiB = 1 << 30

@dataclass(frozen=True)
class ModelConfig:
    """What the model is: its checkpoint, shapes and numeric type."""

    model: str
    tokenizer: str
    served_model_name: str
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int
    load_format: str
    quantization: Optional[str]
    quant_config: Optional[dict[str, Any]]
    chat_template: Optional[str]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # the engine's host settings: which CPU kernels the model's layers, its attention backend and quant method
    # run (each component reads them when it is built; the engine's own, so engines in one process differ)
    host: HostConfig = field(default_factory=resolve_host_config)  # built without one: the environment's
    # every reduction in an order that does not depend on the batch (``--batch-invariant``): the model's linears,
    # its attention backend and sampler give a request the same bits whatever else runs (docs/batch_invariance.md)
    batch_invariant: bool = False
    # what a request that does not set them samples with (``SamplingParams`` fields: temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens), from the model's generation_config.json (``--generation-config``)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # the most logprobs a request may ask for per token (``--max-logprobs``; the vocabulary for -1)
    max_logprobs: int = MAX_LOGPROBS
    # what a sampled token's logprobs hold (``--logprobs-mode``, vLLM's names): raw_logprobs, raw_logits,
    # processed_logprobs or processed_logits (after bias, bans, penalties, temperature, top-k/top-p and min-p)
    logprobs_mode: str = "raw_logprobs"


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is laid out and sized."""

    block_size: int
    kv_cache_memory_bytes: int
    kv_cache_dtype: str
    enable_prefix_caching: bool
    num_gpu_blocks_override: Optional[int]
    swap_space_bytes: int
    preemption_mode: str
    kv_allocator: str
    # the prefix cache's offload tiers: CPU RAM, then block files under a directory (0 / None: off)
    kv_offload_ram_bytes: int = 0
    kv_offload_disk_dir: Optional[str] = None
    kv_offload_disk_bytes: int = 0
    # "auto": layers with a sliding window keep their K/V in a pool of their own, sized to their window
    # (pagoda.kv.window); "off": every layer keeps every token's K/V
    kv_window_pool: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put in one step."""

    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    max_waiting_requests: Optional[int]
    max_waiting_tokens: Optional[int] = None
    # draft slots a decoding request may get per step (speculative decoding; 0 = off)
    num_speculative_tokens: int = 0
    # sequences one tenant may have waiting to start (the server answers that tenant 503 beyond it; None: no bound)
    max_waiting_per_tenant: Optional[int] = None
    # after the served engine wakes from idle, it waits for more arrivals while they come at most this many ms
    # apart (at most 8 such gaps) before its first step, so that requests sent together share it (0: no wait)
    idle_gather_ms: float = 0.0
    # the policy's own options (``scheduler_options``), passed to its factory as keyword arguments
    policy_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    cpu_threads: Optional[int]  # per rank
    distributed_executor_backend: str = "auto"
    all_reduce_backend: str = "auto"
    # pipeline parallelism: stages of tensor_parallel_size ranks each, and the decoder layers of each stage
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] = ()  # filled when pipeline_parallel_size > 1
    # the parts a step's requests are split into, run through the stages one behind the other (1: serial)
    pipeline_micro_batches: int = 1
    # steps in the stages at once (1: one step at a time): while the later stages run one step, the first runs the
    # next, scheduled from sequences that are in no step in flight (docs/distributed.md)
    pipeline_batches_in_flight: int = 1

    @property
    def world_size(self) -> int:
        """Ranks the model runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: how many adapters share a step, their largest rank, how many stay loaded."""

    max_loras: int  # adapters the requests of one step may use together (slots of the stacked weights)
    max_lora_rank: int
    max_cpu_loras: int  # adapters kept loaded in memory, the least recently used evicted
    backend: str = "cpu"  # the pagoda_lora_backends component that computes the LoRA terms
    # name=path adapters registered when the engine starts (ids 1, 2, ... in this order)
    lora_modules: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class KVConnectorConfig:
    """A KV connector by name, its own options, and which way blocks go (docs/kv_connectors.md)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    # "both": save finished prefills and load at admission; "save" (a prefill instance): save only;
    # "load" (a decode instance): load only
    role: str = "both"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated; passed down whole."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    host: HostConfig  # the same object as model.host
    speculative: Optional[SpeculativeConfig]
    attention_backend: str
    sampler: str
    device: str
    # keep the counters and latency histograms of EngineStats (Prometheus /metrics); the offline LLM does not
    log_stats: bool = True
    # the structured-output backend of requests that name none (auto: per request, the first that supports it)
    structured_outputs_backend: str = "auto"
    # a constraint's characters (a schema's compact JSON) compiled at most; longer ones are refused
    structured_outputs_max_chars: int = 65536
    # seconds one compile may take before it is stopped (and its request refused)
    structured_outputs_compile_timeout: float = 10.0
    # bytes of compiled grammars kept for reuse
    structured_outputs_cache_bytes: int = 512 << 20
    # multi-LoRA serving (None: off)
    lora: Optional[LoRAConfig] = None
    # the pagoda_kv_connectors component that saves and loads prompt blocks outside the engine (None: off)
    kv_connector: Optional[KVConnectorConfig] = None
