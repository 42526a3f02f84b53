"""``EngineArgs``: the engine's options, flat (the CLI flags), validated and turned into an
:class:`~pagoda.config.EngineConfig`."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import ConfigDict, Field, ValidationError, create_model, field_validator

from pagoda.config import (GiB, CacheConfig, EngineConfig, KVConnectorConfig, LoRAConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig, SpeculativeConfig)
from pagoda.engine.generation_config import sampling_defaults
from pagoda.errors import ConfigError
from pagoda.host.dtypes import KV_CACHE_DTYPE_CHOICES, resolve_dtype, resolve_kv_cache_dtype
from pagoda.sampling_params import MAX_LOGPROBS
from pagoda.host.env import HOST_OPTIONS, HostConfig, HostOption, resolve_host_config
from pagoda.modeling.loader import auto_load_format

# the older flags of the fair policy -> its option each sets (the same as --scheduler-options '{"option": ...}')
# the served engine's wait for more arrivals after waking from idle (EngineArgs.idle_gather_ms)
IDLE_GATHER_MS = 3.0
FAIR_FLAGS = {"tenant_weights": "tenant_weights", "fair_step_seqs": "step_seqs", "fair_step_ms": "step_ms"}


def _host_field(option: HostOption) -> tuple[Any, Any]:
    """The EngineArgs field of a host setting: None (not given) by default; its help names its variable."""
    builtin = "measured at start-up" if option.default is None else option.default
    if isinstance(builtin, bool):
        builtin = "on" if builtin else "off"
    elif isinstance(builtin, float):
        builtin = f"{builtin:g}"
    kind = Literal[option.choices] if option.choices else option.kind
    bounds = {} if option.minimum is None else {"ge": option.minimum}
    return Optional[kind], Field(default=None, description=f"{option.help} (default: ${option.variable}, else "
                                                             f"{builtin})", **bounds)


# the host settings as options, made from their one list (HostConfig's fields); None takes the environment
# variable, else the built-in default
HostOptions = create_model("HostOptions", **{option.name: _host_field(option) for option in HOST_OPTIONS})


def parse_tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``"alice=2,bob=0.5"`` as ``(("alice", 2.0), ("bob", 0.5))``; ValueError saying what is wrong."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, weight = item.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not name.strip() or not value > 0 or value == float("inf"):
            raise ValueError(f"tenant weight {item!r} is not name=weight with a positive number (e.g. alice=2)")
        pairs.append((name.strip(), value))
    return tuple(pairs)


class EngineArgs(HostOptions):
    """The engine's options, flat, named like vLLM's flags (``--max-model-len`` is ``max_model_len``); the host
    settings among them come from ``HostOptions``."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = Field(default=None, gt=0)
    seed: int = 0
    load_format: str = Field(default="auto", description=(
        "how weights are read: auto (safetensors files where the checkpoint has them, else its PyTorch files), "
        "safetensors, pt (pytorch_model*.bin or *.pt, tensors only: a file holding code is refused), dummy "
        "(random weights), or a pagoda_model_loaders plugin"))
    quantization: Optional[str] = Field(default=None, description=(
        "weight quantization: awq, gptq, compressed-tensors or fp8 checkpoints are detected from their "
        "quantization_config; on a dense checkpoint fp8 (FP8 weights) or int8 (W8A8: int8 weights per channel, "
        "int8 activations per token, integer dot products) quantize it while it loads"))
    chat_template: Optional[str] = None
    generation_config: str = Field(default="auto", description=(
        "where requests that do not set them take their sampling defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens) from: auto (the model's generation_config.json), none (pagoda's own: "
        "temperature 1, top_p 1; vllm is accepted for it too) or a folder holding a generation_config.json"))
    override_generation_config: Optional[dict[str, Any]] = Field(default=None, description=(
        "sampling defaults set on top of --generation-config, as JSON: '{\"temperature\": 0.5}'"))
    block_size: int = Field(default=16, gt=0)
    kv_cache_memory_bytes: Optional[int] = Field(default=None, gt=0)
    kv_cache_dtype: str = Field(default="auto", description=(
        "how K/V are stored: auto (the model dtype) or fp8 (alias fp8_e4m3: scaled float8 e4m3, twice the "
        "tokens in the same memory)"))
    enable_prefix_caching: bool = True
    batch_invariant: bool = Field(default=False, description=(
        "a request's tokens and logprobs bit-identical whatever else is in its batch, at any position, with any "
        "chunking, from a prefix-cache hit or a cold prefill, after preemption (every reduction in a fixed order; "
        "dense models only; see docs/batch_invariance.md)"))
    num_gpu_blocks_override: Optional[int] = Field(default=None, gt=0)
    swap_space: float = Field(default=4.0, ge=0, description="GiB of CPU memory for swapped-out KV blocks")
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    kv_allocator: str = "paged"
    kv_offload_ram: float = Field(default=0.0, ge=0, description=(
        "GiB of CPU RAM keeping prefix-cache blocks evicted from the KV cache, loaded back on a later hit "
        "instead of recomputed (0: off)"))
    kv_offload_disk: Optional[str] = Field(default=None, description=(
        "an existing directory for prefix-cache blocks evicted from the RAM tier (or the KV cache), one "
        "checksummed file per block; kept across restarts (needs --kv-offload-disk-size)"))
    kv_offload_disk_size: float = Field(default=0.0, ge=0, description=(
        "GiB the --kv-offload-disk files may take; the least recently used go first"))
    kv_window_pool: Literal["auto", "off"] = Field(default="auto", description=(
        "auto: layers with a sliding window shorter than --max-model-len keep only their window's K/V, in a "
        "smaller pool of their own, and the memory saved goes to the full layers' blocks (docs/models.md); "
        "off: every layer keeps every token's K/V"))
    kv_connector: Optional[str] = Field(default=None, description=(
        "a KV connector (pagoda_kv_connectors) that saves finished prefills' full prompt blocks outside the "
        "engine and loads them at admission instead of recomputing them: shared-disk (a folder several engines "
        "share) or tcp (a block server); see docs/kv_connectors.md (default: none)"))
    kv_connector_options: Optional[dict[str, Any]] = Field(default=None, description=(
        "the KV connector's own options, a JSON object (e.g. '{\"path\": \"/shared/kv\"}' for shared-disk)"))
    kv_role: Literal["both", "prefill", "decode"] = Field(default="both", description=(
        "which way blocks go through the KV connector: both (save and load), prefill (save only: a prefill "
        "instance) or decode (load only: a decode instance)"))
    scheduling_policy: str = "fcfs"
    scheduler_options: Optional[dict[str, Any]] = Field(default=None, description=(
        "the scheduling policy's own options, a JSON object (e.g. '{\"step_seqs\": 4}' for fair; each "
        "policy's options are in docs/plugins.md, the fair policy's in docs/fairness.md)"))
    tenant_weights: Optional[str] = Field(default=None, description=(
        "the fair scheduling policy's tenant weights, name=weight pairs separated by commas (a tenant weighing 2 "
        "gets twice the service of one weighing 1; unlisted tenants weigh 1); the same as --scheduler-options "
        "'{\"tenant_weights\": {\"name\": weight}}'"))
    fair_step_seqs: Optional[int] = Field(default=None, ge=0, description=(
        "the fair scheduling policy: while a light tenant (at most this many sequences, or a quarter of the "
        "largest tenant's) is active beside others, it runs all its sequences and the heavy tenants share what is "
        "left of this many per step by weight (each at least one). 0: no such bound (default 2); the same as "
        "--scheduler-options '{\"step_seqs\": N}'"))
    fair_step_ms: Optional[float] = Field(default=None, ge=0, description=(
        "the fair scheduling policy: while no light tenant is active, a step runs only as many of the running "
        "sequences as fit in this many milliseconds at the measured time per sequence (at least step_seqs; the "
        "sequences take turns). 0: no bound (default 250); the same as --scheduler-options '{\"step_ms\": N}'"))
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: Optional[int] = Field(default=None, gt=0)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    max_waiting_requests: Optional[int] = Field(default=None, gt=0)
    max_waiting_tokens: Optional[int] = Field(
        default=None, gt=0, description="prompt plus max_tokens, times n, of the requests not yet started, at most "
                                        "(the server answers 503 beyond it; default: no bound)")
    max_waiting_per_tenant: Optional[int] = Field(
        default=None, gt=0, description="sequences one tenant (see pagoda serve --tenant-source) may have waiting to "
                                        "start; beyond it that tenant alone gets 503 (default: no bound)")
    idle_gather_ms: float = Field(default=IDLE_GATHER_MS, ge=0, le=1000, description=(
        "pagoda serve: when the engine wakes from idle on a request, it first waits while more requests arrive "
        "at most this many milliseconds apart (for at most 8 such gaps), so that requests sent together are "
        "prefilled in one step; 0: start the first step at once"))
    tensor_parallel_size: int = Field(default=1, gt=0, description=(
        "ranks the model is split over (its heads, MLP columns and vocabulary), each a process"))
    pipeline_parallel_size: int = Field(default=1, gt=0, description=(
        "pipeline stages the model's decoder layers are split over, each of tensor_parallel_size ranks "
        "(tensor_parallel_size x pipeline_parallel_size processes; stages pass one activation hand-off per step, "
        "so they may sit on machines joined by a slow link: see docs/distributed.md)"))
    pipeline_layer_partition: Optional[str] = Field(default=None, description=(
        "decoder layers per pipeline stage, comma-separated, summing to the model's layer count (e.g. 12,18); "
        "default: an even split, the first stages one layer more when the count does not divide"))
    pipeline_micro_batches: int = Field(default=1, gt=0, description=(
        "with pipeline_parallel_size > 1: the parts each step's requests are split into, run through the stages "
        "one behind the other so that stage 2 runs part 1 while stage 1 runs part 2 (1: the step whole, one stage "
        "at a time); each stage then reads its weights once per part, so decode steps bound by weight reads gain "
        "little: see docs/distributed.md"))
    pipeline_batches_in_flight: Optional[int] = Field(default=None, gt=0, description=(
        "with pipeline_parallel_size > 1: steps in the stages at once, each of other sequences, so that stage 2 "
        "runs one step while stage 1 runs the next (1: one step at a time); default pipeline_parallel_size"))
    distributed_executor_backend: str = Field(default="auto", description=(
        "the processes a model runs in: uni (one), mp (tensor_parallel_size x pipeline_parallel_size processes "
        "on this machine), ray (Ray actors, on one machine or a cluster), or an executor plugin; auto picks uni "
        "for one rank, mp for more"))
    all_reduce_backend: str = Field(default="auto", description=(
        "how tensor-parallel ranks sum their parts: gloo (torch.distributed; NCCL on GPUs), shm (shared memory, "
        "ranks on one host, CPU), or an all-reduce plugin; auto picks shm when every rank is on this host and "
        "the model runs on CPU, else gloo"))
    speculative_config: Optional[dict[str, Any]] = None
    attention_backend: str = "auto"
    sampler: str = "default"
    structured_outputs_backend: str = Field(default="auto", description=(
        "the structured-output backend of requests that name none: xgrammar, guidance (llguidance), a plugin's, "
        "or auto (per request, the first that can compile its constraint: xgrammar, then guidance)"))
    structured_outputs_max_chars: int = Field(default=65536, gt=0, description=(
        "the longest constraint compiled, in characters (a JSON schema as compact JSON, a regex, a grammar); "
        "longer ones are refused with a 400"))
    structured_outputs_compile_timeout: float = Field(default=10.0, gt=0, description=(
        "seconds one constraint may take to compile; a compile past it (or one whose client left) is stopped, "
        "and its request refused with a 400"))
    structured_outputs_cache_mb: int = Field(default=512, ge=0, description=(
        "MiB of compiled grammars kept for reuse (least recently used dropped first)"))
    device: str = "auto"
    enable_lora: bool = Field(default=False, description=(
        "serve LoRA adapters (PEFT directories) on the base model: requests name one (the OpenAI 'model' field, "
        "LLM.generate's lora_request) and requests of different adapters share a step"))
    lora_modules: Optional[list[str]] = Field(default=None, description=(
        "adapters served by name from the start, as NAME=PATH (PATH: a directory PEFT's save_pretrained wrote); "
        "needs --enable-lora"))
    max_loras: int = Field(default=1, gt=0, description="distinct LoRA adapters the requests of one step may use")
    max_lora_rank: int = Field(default=16, gt=0, le=64, description="the largest LoRA rank served (at most 64)")
    max_cpu_loras: Optional[int] = Field(default=None, gt=0, description=(
        "LoRA adapters kept loaded in memory, the least recently used evicted (default: --max-loras)"))
    lora_backend: str = Field(default="cpu", description=(
        "what computes the LoRA terms of a step's adapters: cpu (a C++ kernel computing every adapter of a layer in "
        "one call; torch's matmuls off the CPU), torch, triton, or a pagoda_lora_backends plugin"))
    disable_log_stats: bool = Field(default=False, description=(
        "keep no request counters or latency histograms (/metrics then shows only the live gauges: running, "
        "waiting, KV cache use, prefix cache, preemptions); the offline LLM keeps none unless given "
        "disable_log_stats=False"))
    max_logprobs: int = Field(default=MAX_LOGPROBS, ge=-1, description=(
        "the most logprobs a request may ask for per token (completions' logprobs, chat's top_logprobs, "
        "prompt_logprobs); more is refused with a 400 naming this limit; -1: up to the whole vocabulary"))
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = Field(
        default="raw_logprobs", description=(
            "what a sampled token's logprobs hold: raw_logprobs, the log-softmax of the model's logits before any "
            "sampling setting applies; raw_logits, those logits; processed_logprobs and processed_logits, the "
            "same after the request's logit bias, bans, penalties, temperature, top-k, top-p and min-p (the "
            "distribution the token was drawn from; a token those settings removed has -9999.0); prompt logprobs "
            "stay raw_logprobs"))

    @field_validator("block_size")
    @classmethod
    def _block_size_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {v}")
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _check_tenant_weights(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_tenant_weights(v)
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_cache_dtype(cls, v: str) -> str:
        if v not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)} "
                             "(fp8 is float8 e4m3 with a per-layer scale)")
        return v

    @classmethod
    def build(cls, **kwargs: Any) -> "EngineArgs":
        """Validate keyword options; raise ConfigError naming each bad field."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise ConfigError(_describe_validation_error(exc)) from None

    def host_config(self) -> HostConfig:
        """The host settings these options give, with environment variables for the ones not given."""
        return resolve_host_config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(HostConfig)})

    def _check_tensor_parallel(self, model_cfg: "ModelConfig", spec_cfg: Optional[SpeculativeConfig]) -> None:
        """What tensor parallelism cannot run, refused before any process starts."""
        from pagoda.execution import distributed

        size = self.tensor_parallel_size
        for rank in range(size):  # raises for a head count the ranks cannot share
            distributed.head_shard(model_cfg.num_heads, model_cfg.num_kv_heads, distributed.TensorParallel(rank, size))
        if self.distributed_executor_backend == "uni":
            raise ConfigError(f"the uni executor runs one process; tensor_parallel_size={size} needs "
                              "distributed_executor_backend='mp' (or auto)")
        if spec_cfg is not None and spec_cfg.model and not spec_cfg.model.startswith("self:"):
            raise ConfigError("a draft checkpoint is not sharded for tensor parallelism yet; with "
                              "tensor_parallel_size > 1 use the ngram method or a self-draft (\"self:layers=N\")")

    def _pipeline_partition(self, model_cfg: "ModelConfig", spec_cfg: Optional[SpeculativeConfig]) -> tuple[int, ...]:
        """The decoder layers of each pipeline stage (empty with one stage); what pipeline parallelism cannot
        run is refused here, before any process starts."""
        from pagoda.execution.pipeline import layer_partition, parse_partition

        size = self.pipeline_parallel_size
        if size == 1:
            if self.pipeline_layer_partition is not None:
                raise ConfigError(f"pipeline_layer_partition {self.pipeline_layer_partition!r} needs "
                                  "--pipeline-parallel-size > 1; pass the stage count, or drop the partition")
            if self.pipeline_micro_batches > 1:
                raise ConfigError(f"pipeline_micro_batches={self.pipeline_micro_batches} needs "
                                  "--pipeline-parallel-size > 1; pass the stage count, or drop it")
            if (self.pipeline_batches_in_flight or 1) > 1:
                raise ConfigError(f"pipeline_batches_in_flight={self.pipeline_batches_in_flight} needs "
                                  "--pipeline-parallel-size > 1; pass the stage count, or drop it")
            return ()
        if (self.pipeline_batches_in_flight or 1) > size:
            raise ConfigError(f"pipeline_batches_in_flight={self.pipeline_batches_in_flight} is more than the "
                              f"{size} pipeline stages: a stage runs one step at a time, so more steps in flight "
                              f"only wait; pass --pipeline-batches-in-flight <= {size}")
        explicit = None if self.pipeline_layer_partition is None else parse_partition(self.pipeline_layer_partition)
        partition = layer_partition(model_cfg.num_layers, size, explicit)
        if self.distributed_executor_backend == "uni":
            raise ConfigError(f"the uni executor runs one process; pipeline_parallel_size={size} needs "
                              "distributed_executor_backend='mp' or 'ray' (or auto)")
        if spec_cfg is not None:
            raise ConfigError("speculative decoding does not run over pipeline stages yet (a draft model needs every "
                              "layer in one process, and each stage would propose drafts of its own); drop "
                              "speculative_config or use pipeline_parallel_size=1")
        if self.kv_offload_ram or self.kv_offload_disk:
            raise ConfigError("the --kv-offload-* tiers do not keep K/V per pipeline stage yet; drop them or use "
                              "pipeline_parallel_size=1")
        return partition

    def _check_batch_invariant(self, quantization: Optional[str]) -> None:
        """The batch-invariant mode covers dense unquantized weights without LoRA adapters: refuse the rest."""
        if not self.batch_invariant:
            return
        if quantization:
            raise ConfigError(f"--batch-invariant covers unquantized models; this one is {quantization}-quantized, "
                              "whose matmul kernels are not batch-invariant: drop --batch-invariant or load a "
                              "dense checkpoint")
        if self.enable_lora:
            raise ConfigError("--batch-invariant does not cover LoRA adapters (their matmuls are batched across "
                              "adapters): drop --enable-lora or --batch-invariant")

    def _check_kv_offload(self) -> None:
        """The offload flags go together, extend the prefix cache, and name a directory pagoda can write."""
        disk, size = self.kv_offload_disk, self.kv_offload_disk_size
        if disk is not None and not size:
            raise ConfigError(f"--kv-offload-disk {disk} needs a size limit: add --kv-offload-disk-size GiB")
        if size and disk is None:
            raise ConfigError(f"--kv-offload-disk-size {size:g} needs a directory: add --kv-offload-disk DIR")
        if (disk is not None or self.kv_offload_ram) and not self.enable_prefix_caching:
            raise ConfigError("the --kv-offload-* tiers keep prefix-cache blocks, so they need prefix caching: drop "
                              "--no-enable-prefix-caching or the --kv-offload-* flags")
        if disk is not None:
            if not os.path.isdir(disk):
                raise ConfigError(f"--kv-offload-disk {disk} is not an existing directory; create it (mkdir -p "
                                  f"{disk}) or pass another")
            try:
                with tempfile.NamedTemporaryFile(dir=disk, prefix=".pagoda-write-check-"):
                    pass
            except OSError as exc:
                raise ConfigError(f"--kv-offload-disk {disk} is not writable ({exc.strerror}); pass a directory "
                                  "pagoda may create files in") from None

    def _kv_connector_config(self) -> Optional[KVConnectorConfig]:
        """The KV connector's name, options and role, checked together; None when off."""
        if self.kv_connector is None:
            if self.kv_connector_options is not None or self.kv_role != "both":
                raise ConfigError("--kv-connector-options and --kv-role need --kv-connector NAME (shared-disk, tcp): "
                                  "add it, or drop them")
            return None
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ConfigError("a KV connector moves one rank's blocks; it does not run with tensor or pipeline "
                              "parallelism yet: use tensor_parallel_size=1 and pipeline_parallel_size=1, or drop "
                              "--kv-connector")
        if self.speculative_config and self.speculative_config.get("method") == "draft_model":
            raise ConfigError("a KV connector does not move a draft model's own KV cache; drop --kv-connector or "
                              "use a speculative method without a draft model (ngram)")
        if self.enable_lora:
            raise ConfigError("a KV connector does not key blocks by LoRA adapter yet; drop --kv-connector or "
                              "--enable-lora")
        return KVConnectorConfig(self.kv_connector, dict(self.kv_connector_options or {}), self.kv_role)

    def _lora_config(self) -> Optional[LoRAConfig]:
        """The LoRA options, checked together; None when LoRA is off."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("--lora-modules needs --enable-lora: add it, or drop the adapters")
            return None
        if self.pipeline_parallel_size > 1:
            raise ConfigError("LoRA does not run with pipeline parallelism yet (tensor parallelism it does): use "
                              "pipeline_parallel_size=1, or drop --enable-lora")
        if self.speculative_config:
            raise ConfigError("speculative decoding does not apply LoRA adapters to its drafts yet; drop "
                              "speculative_config or --enable-lora")
        if self.kv_offload_ram or self.kv_offload_disk:
            raise ConfigError("the --kv-offload-* tiers do not key blocks by LoRA adapter yet; drop them or "
                              "--enable-lora")
        modules = []
        for item in self.lora_modules or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: write each adapter as NAME=PATH, e.g. "
                                  "sql-lora=/adapters/sql")
            if name in (n for n, _ in modules):
                raise ConfigError(f"--lora-modules names {name!r} twice; give each adapter a name of its own")
            modules.append((name, str(Path(path).expanduser())))
        max_cpu_loras = self.max_cpu_loras or self.max_loras
        if max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras {max_cpu_loras} is smaller than --max-loras {self.max_loras}; the "
                              "adapters of one step must all be in memory: pass --max-cpu-loras >= --max-loras")
        return LoRAConfig(self.max_loras, self.max_lora_rank, max_cpu_loras, self.lora_backend, tuple(modules))

    def _scheduler_options(self) -> dict[str, Any]:
        """``scheduler_options``, with what the fair policy's older flags set; those flags name no option of
        another policy, so with another policy they are an error saying so."""
        options = dict(self.scheduler_options or {})
        for flag, option in FAIR_FLAGS.items():
            value = getattr(self, flag)
            if value is None:
                continue
            cli_flag = "--" + flag.replace("_", "-")
            if self.scheduling_policy != "fair":
                raise ConfigError(f"{cli_flag} is an option of the fair scheduling policy, not of "
                                  f"{self.scheduling_policy!r}; add --scheduling-policy fair, or drop {cli_flag}")
            if option in options:
                raise ConfigError(f"{cli_flag} and --scheduler-options both set the fair policy's {option!r}; "
                                  "give it once")
            options[option] = dict(parse_tenant_weights(value)) if flag == "tenant_weights" else value
        return options

    def create_engine_config(self) -> EngineConfig:
        from pagoda.modeling.default_model import resolve_model_path

        # first: a malformed variable fails before the model is read
        host = self.host_config()
        cpu_threads = host.cpu_threads
        num_ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if num_ranks > 1 and cpu_threads is None:
            # ranks on one machine share its cores; no rank measures for itself
            cpu_threads = max(1, (os.cpu_count() or 1) // num_ranks)
        model_dir = resolve_model_path(self.model)
        hf_config = load_hf_config(model_dir)
        text_config = hf_config.get("text_config", hf_config)
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ConfigError(f"{model_dir}/config.json has no 'architectures' entry; cannot tell which model to build")
        num_heads = int(text_config["num_attention_heads"])
        hidden_size = int(text_config["hidden_size"])
        head_dim = int(text_config.get("head_dim") or hidden_size // num_heads)
        model_max_len = int(text_config.get("max_position_embeddings", 2048))
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's {model_max_len} positions "
                f"(max_position_embeddings in {model_dir}/config.json); pass a value <= {model_max_len}"
            )
        quant_config = hf_config.get("quantization_config")
        quant_cfg_file = Path(model_dir, "quant_config.json")
        if quant_config is None and quant_cfg_file.exists():
            quant_config = json.loads(quant_cfg_file.read_text())
        quant_cfg_file = Path(model_dir, "quantize_config.json")
        if quant_config is None and quant_cfg_file.exists():
            quant_config = json.loads(quant_cfg_file.read_text())
        quantization = self.quantization
        if quantization in (None, "auto") and quant_config is not None:
            quantization = quant_config.get("quant_method")
        if quantization == "auto":
            quantization = None
        chat_template = self.chat_template
        if chat_template and os.path.isfile(chat_template):
            chat_template = Path(chat_template).read_text()
        model_cfg = ModelConfig(
            model=str(model_dir),
            tokenizer=_tokenizer_dir_of(self.tokenizer) or str(model_dir),
            served_model_name=self.served_model_name or (self.model or "SmolLM2-135M-Instruct"),
            hf_config=hf_config,
            architecture=architectures[0],
            dtype=resolve_dtype(self.dtype, host.cpu_isa, host.fused_cpu_ops),
            max_model_len=max_model_len,
            seed=self.seed,
            load_format=auto_load_format(Path(model_dir)) if self.load_format == "auto" else self.load_format,
            quantization=quantization,
            quant_config=quant_config,
            chat_template=chat_template,
            vocab_size=int(text_config["vocab_size"]),
            max_logprobs=int(text_config["vocab_size"]) if self.max_logprobs == -1 else self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            hidden_size=hidden_size,
            num_layers=int(text_config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(text_config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            host=host,
            batch_invariant=self.batch_invariant,
            sampling_defaults=sampling_defaults(model_dir, self.generation_config, self.override_generation_config),
        )
        max_num_batched_tokens = self.max_num_batched_tokens or (
            2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        )
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens {max_num_batched_tokens} is smaller than max_model_len {max_model_len} "
                "with chunked prefill disabled, so the longest prompts could never be scheduled; raise "
                "--max-num-batched-tokens or enable chunked prefill"
            )
        if self.max_num_seqs > max_num_batched_tokens:
            raise ConfigError(
                f"max_num_seqs {self.max_num_seqs} exceeds max_num_batched_tokens {max_num_batched_tokens}; "
                "every running sequence needs at least one token of the step budget"
            )
        resolve_kv_cache_dtype(self.kv_cache_dtype, model_cfg.dtype)  # refuses a float dtype not the model's
        self._check_batch_invariant(quantization)
        self._check_kv_offload()
        cache_cfg = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes or 2 * GiB,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            swap_space_bytes=int(self.swap_space * GiB),
            preemption_mode=self.preemption_mode,
            kv_allocator=self.kv_allocator,
            kv_offload_ram_bytes=int(self.kv_offload_ram * GiB),
            kv_offload_disk_dir=str(Path(self.kv_offload_disk).resolve()) if self.kv_offload_disk else None,
            kv_offload_disk_bytes=int(self.kv_offload_disk_size * GiB),
            kv_window_pool=self.kv_window_pool,
        )
        spec_cfg = None
        if self.speculative_config:
            spec = dict(self.speculative_config)
            if "method" not in spec or "num_speculative_tokens" not in spec:
                raise ConfigError(
                    "speculative_config needs 'method' and 'num_speculative_tokens', e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                )
            known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min"}
            spec_cfg = SpeculativeConfig(
                **{k: v for k, v in spec.items() if k in known},
                extra={k: v for k, v in spec.items() if k not in known},
            )
            if not isinstance(spec_cfg.num_speculative_tokens, int) or spec_cfg.num_speculative_tokens < 1:
                raise ConfigError(
                    f"speculative_config num_speculative_tokens={spec_cfg.num_speculative_tokens!r}; pass an "
                    "integer of at least 1 (or leave speculative_config out to decode one token per step)"
                )
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel(model_cfg, spec_cfg)
        partition = self._pipeline_partition(model_cfg, spec_cfg)
        lora_cfg = self._lora_config()
        sched_cfg = SchedulerConfig(
            policy=self.scheduling_policy,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_waiting_requests=self.max_waiting_requests,
            max_waiting_tokens=self.max_waiting_tokens,
            max_waiting_per_tenant=self.max_waiting_per_tenant,
            idle_gather_ms=self.idle_gather_ms,
            num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0,
            policy_options=self._scheduler_options(),
        )
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return EngineConfig(
            model=model_cfg,
            cache=cache_cfg,
            scheduler=sched_cfg,
            parallel=ParallelConfig(self.tensor_parallel_size, cpu_threads, self.distributed_executor_backend,
                                    self.all_reduce_backend, self.pipeline_parallel_size, partition,
                                    self.pipeline_micro_batches,
                                    self.pipeline_batches_in_flight or self.pipeline_parallel_size),
            host=host,
            speculative=spec_cfg,
            attention_backend=self.attention_backend,
            sampler=self.sampler,
            device=device,
            log_stats=not self.disable_log_stats,
            structured_outputs_backend=self.structured_outputs_backend,
            structured_outputs_max_chars=self.structured_outputs_max_chars,
            structured_outputs_compile_timeout=self.structured_outputs_compile_timeout,
            structured_outputs_cache_bytes=self.structured_outputs_cache_mb << 20,
            lora=lora_cfg,
            kv_connector=self._kv_connector_config(),
        )


def _tokenizer_dir_of(tokenizer: Optional[str]) -> Optional[str]:
    """``--tokenizer`` as a folder: as given when it exists, else a Hub id's snapshot in the local Hugging Face
    cache; None when not given."""
    from pagoda.modeling.default_model import resolve_model_path

    if not tokenizer or Path(tokenizer).expanduser().exists():
        return str(Path(tokenizer).expanduser()) if tokenizer else None
    try:
        return str(resolve_model_path(tokenizer))
    except ConfigError as exc:
        raise ConfigError(f"--tokenizer: {exc}") from None


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    config_path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist; pass a local Hugging Face checkpoint directory")
    if not config_path.exists():
        raise ConfigError(
            f"{model_dir} has no config.json, so it is not a Hugging Face checkpoint directory; "
            "pass a directory holding config.json and its weights (*.safetensors, or pytorch_model*.bin)"
        )
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None


def _describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "options"
        given = err.get("input")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown option {name!r}; see `pagoda serve --help` for the options")
        else:
            parts.append(f"{name}={given!r}: {err['msg']}")
    return "invalid engine options: " + "; ".join(parts)
