"""Builds one rank's model runner: its model shard, loaded, its attention backend, the KV cache sized to
the memory given, its sampler and proposer, and the offload tiers. Executors call it on every rank."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Any, Iterator

import torch

from pagoda.config import EngineConfig
from pagoda.errors import BackendUnavailable, ConfigError
from pagoda.execution import distributed
from pagoda.execution.lora import LoRAFollower, LoRAManager, LoRASlots
from pagoda.execution.model_runner import ModelRunner
from pagoda.execution.window_pool import plan_window_pool
from pagoda.host import hugepages
from pagoda.host.dtypes import is_fp8_kv_cache, resolve_kv_cache_dtype, stored_kv_dtype
from pagoda.interfaces import AttentionBackend
from pagoda.registry.adapt import adapt_component
from pagoda.registry.plugin_manager import PluginManager

logger = logging.getLogger("pagoda")


def build_runner(config: EngineConfig, pm: PluginManager) -> ModelRunner:
    """This rank's model shard (the whole model alone), loaded, with its KV cache, sampler and proposer."""
    mc, cc = config.model, config.cache
    arch = pm.get("pagoda_model_architectures", mc.architecture, "the checkpoint's architectures")
    loader_cls = pm.get("pagoda_model_loaders", mc.load_format, "load_format").factory
    sampler_cls = pm.get("pagoda_samplers", config.sampler, "sampler").factory
    quant = None
    if mc.quantization:
        quant_factory = pm.get("pagoda_quant_methods", mc.quantization, "quantization").factory
        quant = adapt_component(quant_factory(mc, mc.quant_config or {}), "pagoda_quant_methods", mc.quantization)
    proposer = None
    if config.speculative is not None:
        proposer = pm.get("pagoda_proposers", config.speculative.method, "speculative_config method").factory
    sampler = adapt_component(sampler_cls(mc), "pagoda_samplers", config.sampler)
    if config.speculative is not None:
        if not sampler.samples_standard_distribution:
            raise ConfigError(
                f"sampler {config.sampler!r} does not sample the standard distribution of the sampling "
                "parameters (samples_standard_distribution is not True), and speculative decoding would verify "
                "drafts against that distribution instead of the sampler's; drop speculative_config or use "
                "sampler='default'"
            )
    tp = distributed.current()
    heads = distributed.head_shard(mc.num_heads, mc.num_kv_heads, tp)
    # the backend sees this rank's heads
    rank_config = config if tp.size == 1 else dataclasses.replace(
        config, model=dataclasses.replace(mc, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads))
    backend = select_attention_backend(rank_config, pm)
    check_kv_cache_dtype(config, backend)
    if mc.batch_invariant:
        check_batch_invariant(backend, sampler, config.sampler)

    with torch.device(config.device):
        model = adapt_component(arch.factory(mc, backend, quant), "pagoda_model_architectures", arch.name)
    check_attention_features(model, backend)
    loader = adapt_component(loader_cls(mc), "pagoda_model_loaders", mc.load_format)
    # huge pages asked for before the loader writes the weights (its writes fault in 2 MiB pages where the
    # memory is fresh), then the rest collapsed: memory reused from the heap, tensors loading made anew
    if config.host.huge_pages:
        hugepages.advise_tensors(model_tensors(model), collapse=False)
    loader.load_weights(model)
    if config.host.huge_pages:
        hugepages.advise_tensors(model_tensors(model))
    model.eval()

    # a pipeline stage keeps its own layers' K/V; every stage has the block count of the one with the most layers
    num_layers = max(config.parallel.pipeline_layer_partition or (mc.num_layers,))
    # every rank has the same block count: the one the rank with the most KV heads can hold
    most = max(distributed.head_shard(mc.num_heads, mc.num_kv_heads, distributed.TensorParallel(r, tp.size))
               .num_kv_heads for r in range(tp.size))
    bytes_per_layer_block = (math.prod(backend.kv_cache_shape(1)) * _kv_element_size(backend, mc.dtype) * most
                             // heads.num_kv_heads)
    bytes_per_block = bytes_per_layer_block * num_layers
    window_pool = plan_window_pool(config, model.layer_windows(), num_layers, bytes_per_layer_block)
    if window_pool is not None:
        num_blocks = window_pool.num_blocks
        # a main block's bytes: the full layers' only
        bytes_per_block = bytes_per_layer_block * (num_layers - len(window_pool.layers))
    else:
        num_blocks = cc.num_gpu_blocks_override or cc.kv_cache_memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_memory_bytes={cc.kv_cache_memory_bytes} holds no KV block ({bytes_per_block} bytes each); "
            "raise it"
        )
    runner = ModelRunner(rank_config, model, backend, sampler, num_blocks, window_pool)
    if config.lora is not None:
        runner.lora = build_lora_manager(config, pm, model, runner.device)
    if proposer is not None:
        spec = config.speculative
        runner.set_proposer(adapt_component(proposer(spec, config, runner, pm), "pagoda_proposers", spec.method))
        logger.info("speculative decoding: %s, up to %d draft tokens per step", spec.method,
                    spec.num_speculative_tokens)
    if cc.preemption_mode == "swap" and window_pool is not None:
        logger.info("KV window pool: preempted requests are recomputed (swap moves whole blocks of every layer)")
    elif cc.preemption_mode == "swap":
        # CPU pool for preempted requests' blocks; with no room, preemption falls back to recompute
        runner.allocate_swap_space(cc.swap_space_bytes // bytes_per_block)
    if cc.kv_offload_ram_bytes or cc.kv_offload_disk_dir:
        init_offload_tiers(runner, cc, bytes_per_block, tp.size)
    mapped = "" if runner.prefault_seconds is None else f", mapped at start in {runner.prefault_seconds:.2f} s"
    if runner.prefault_seconds is None and runner.device.type == "cpu" and config.host.kv_cache_prefault:
        logger.warning("the kernel could not map the whole KV cache at start (kv_cache_prefault; short of memory?): "
                       "its pages are mapped as blocks are first used")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB%s)", num_blocks, cc.block_size,
                num_blocks * bytes_per_block / 2**20, mapped)
    if window_pool is not None:
        logger.info("KV window pool: %s (%.1f MiB)", window_pool.summary(),
                    (window_pool.num_slots + 1) * len(window_pool.layers) * bytes_per_layer_block / 2**20)
    return runner


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The model's parameters and buffers."""
    return itertools.chain(model.parameters(), model.buffers())


def build_lora_manager(config: EngineConfig, pm: PluginManager, model: torch.nn.Module,
                       device: torch.device) -> LoRAManager | LoRAFollower:
    """The adapter slots of every adaptable layer of ``model``, computed by the configured LoRA backend: with
    the books of the adapters on rank 0 (the only rank without tensor parallelism), following rank 0's on the
    others."""
    lc = config.lora
    factory = pm.get("pagoda_lora_backends", lc.backend, "lora_backend").factory
    lora_backend = adapt_component(factory(lc, config.model), "pagoda_lora_backends", lc.backend)
    slots = LoRASlots(lc, config.model, model, lora_backend, device)
    is_driver = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not is_driver:
        return LoRAFollower(slots)
    logger.info("LoRA: %d adapter slot(s) of rank %d in %d layers, %d adapter(s) kept in memory (backend %s)",
                lc.max_loras, lc.max_lora_rank, len(slots.layers), lc.max_cpu_loras, lc.backend)
    return LoRAManager(lc, config.model, slots)


def init_offload_tiers(runner: ModelRunner, cc: Any, bytes_per_block: int, num_ranks: int) -> None:
    """The runner's offload tiers, sized alike on every rank: the flags' sizes are for all ranks together,
    each block file holding a header besides its K/V."""
    num_ram = cc.kv_offload_ram_bytes // (bytes_per_block * num_ranks)
    file_bytes = bytes_per_block + 8 * cc.block_size + 128
    num_disk = cc.kv_offload_disk_bytes // (file_bytes * num_ranks) if cc.kv_offload_disk_dir else 0
    for flag, size, num, each in (("--kv-offload-ram", cc.kv_offload_ram_bytes, num_ram, bytes_per_block),
                                  ("--kv-offload-disk-size", cc.kv_offload_disk_bytes, num_disk, file_bytes)):
        if size and not num:
            raise ConfigError(f"{flag} gives {size} bytes, less than one KV block ({each * num_ranks} bytes over "
                              f"{num_ranks} rank(s)); raise it to at least {each * num_ranks / 2**30:.2g} GiB")
    try:
        runner.init_offload(num_ram, cc.kv_offload_disk_dir, num_disk)
    except OSError as exc:
        raise ConfigError(f"--kv-offload-disk {cc.kv_offload_disk_dir}: cannot use it: {exc}") from None
    logger.info("KV offload: %d blocks in RAM, %d on disk%s", num_ram, num_disk,
                f" ({len(runner.kv_tiers.found)} found there)" if num_disk else "")


def select_attention_backend(config: EngineConfig, pm: PluginManager) -> AttentionBackend:
    """The configured attention backend (``auto``: the highest-ranked that can run here), built and adapted
    (:func:`pagoda.registry.adapt.adapt_component`)."""
    name = config.attention_backend
    if name != "auto":
        factory = pm.get("pagoda_attention_backends", name, "attention_backend").factory
        try:
            return adapt_component(factory(config.model, config.cache), "pagoda_attention_backends", name)
        except BackendUnavailable as exc:
            raise ConfigError(f"attention backend {name!r} cannot run here: {exc}") from None
    device = "cuda" if config.device.startswith("cuda") else "cpu"
    reasons = []
    for candidate in auto_backend_order(pm, device):
        try:
            backend = adapt_component(candidate.factory(config.model, config.cache), "pagoda_attention_backends",
                                      candidate.name)
        except BackendUnavailable as exc:
            reasons.append(f"{candidate.name}: {exc}")
            continue
        if config.model.batch_invariant and not backend.batch_invariant:
            reasons.append(f"{candidate.name}: not batch-invariant")
            continue
        return backend
    raise ConfigError("no attention backend can run here: " + "; ".join(reasons or ["none installed"]))


def check_batch_invariant(backend: AttentionBackend, sampler: Any, sampler_name: str) -> None:
    """Refuse, at start-up in the batch-invariant mode, a component that does not claim it (its
    ``batch_invariant``); Mixture-of-Experts models refuse the mode themselves."""
    name = getattr(backend, "name", type(backend).__name__)
    if not backend.batch_invariant:
        raise ConfigError(f"--batch-invariant: attention backend {name!r} does not say it is batch-invariant (its "
                          "batch_invariant is not True); pass --attention-backend cpu or torch, or drop "
                          "--batch-invariant")
    if not sampler.batch_invariant:
        raise ConfigError(f"--batch-invariant: sampler {sampler_name!r} does not say it is batch-invariant (its "
                          "batch_invariant is not True); pass --sampler default, or drop --batch-invariant")


def check_attention_features(model: Any, backend: AttentionBackend) -> None:
    """Refuse, at start-up, a model whose layers ask for sliding windows, logit soft-caps or sinks of a backend
    that does not list them in its ``attention_features``."""
    asks = getattr(model, "attention_features", None)
    needed = set(asks()) if callable(asks) else set()
    missing = needed - set(getattr(backend, "attention_features", None) or ())
    if missing:
        name = getattr(backend, "name", type(backend).__name__)
        raise ConfigError(f"this model's attention uses {', '.join(sorted(missing))}, which attention backend "
                          f"{name!r} does not implement; pass --attention-backend cpu or torch")


def auto_backend_order(pm: PluginManager, device: str) -> list:
    """The attention backends ``auto`` tries on ``device`` ("cpu" or "cuda"), best first: each backend
    declares its rank per device in ``auto_priority`` (higher first; ties by name) and its availability by
    raising BackendUnavailable; one that declares no rank for the device is never picked by ``auto``."""
    available = pm.components.get("pagoda_attention_backends", {}).values()
    ranked = [c for c in available if device in (getattr(c.factory, "auto_priority", None) or {})]
    return sorted(ranked, key=lambda c: (-c.factory.auto_priority[device], c.name))


def check_kv_cache_dtype(config: EngineConfig, backend: AttentionBackend) -> None:
    """Refuse a backend that would store K/V in another dtype than kv_cache_dtype asks for.

    A backend declares its storage in ``kv_cache_dtype`` (the model dtype when it has none); one
    that ignores ``--kv-cache-dtype fp8`` would otherwise give bf16 KV memory silently.
    """
    wanted = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
    stored = stored_kv_dtype(backend, config.model.dtype)
    if stored != wanted:
        hint = ("use attention_backend='cpu' or 'torch' on a CPU, 'triton' on a GPU"
                if is_fp8_kv_cache(config.cache.kv_cache_dtype) else "use kv_cache_dtype='auto'")
        raise ConfigError(
            f"the {backend.name!r} attention backend stores K/V as {str(stored).removeprefix('torch.')}, not "
            f"kv_cache_dtype={config.cache.kv_cache_dtype!r} ({str(wanted).removeprefix('torch.')}); {hint}"
        )


def _kv_element_size(backend: Any, model_dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=stored_kv_dtype(backend, model_dtype)).element_size()
