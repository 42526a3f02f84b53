"""Resolves every component by its configured name, once, at engine start-up, and builds the engine's
side of them (tokenizer, KV allocator, scheduler); each rank's runner is built by
:func:`pagoda.execution.build.build_runner`, through the executor."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.config import EngineConfig
from pagoda.errors import ConfigError
from pagoda.engine.generation_config import eos_token_ids
from pagoda.execution.collectives import all_reduce_candidates
from pagoda.execution.executor import select_executor
from pagoda.execution.model_runner import ModelRunner
from pagoda.kv.connector import KVTransfers, block_payload_bytes
from pagoda.kv.offload import fingerprint
from pagoda.interfaces import has_window_slots
from pagoda.kv.tiers import KVTierIndex, has_offload_tiers
from pagoda.registry.adapt import adapt_component
from pagoda.registry.plugin_manager import PluginManager
from pagoda.scheduling import build_scheduler, check_policy_options
from pagoda.sampling.structured.manager import check_backend_name

logger = logging.getLogger("pagoda")


@dataclass
class Components:
    tokenizer: Any
    model: torch.nn.Module
    backend: Any
    kv_manager: Any
    scheduler: Any
    runner: ModelRunner
    executor: Any
    num_blocks: int
    eos_token_ids: list[int]  # the tokens that end a sequence (generation_config.json's, then the tokenizer's)
    # the KV connector's loads and saves (None: no --kv-connector)
    kv_transfers: Optional[KVTransfers] = None


def build_components(config: EngineConfig, pm: PluginManager) -> Components:
    mc, cc = config.model, config.cache
    # resolve every name first, so a typo fails before any weight is read
    arch = pm.get("pagoda_model_architectures", mc.architecture, "the checkpoint's architectures")
    if mc.architecture in pm.overridden.get("pagoda_model_architectures", {}):
        logger.info("model architecture %s: plugin %r from %s, which overrides pagoda's built-in", mc.architecture,
                    arch.plugin, arch.dist)
    if config.parallel.tensor_parallel_size > 1 and not getattr(arch.factory, "supports_tensor_parallel", False):
        raise ConfigError(f"the {mc.architecture} architecture ({arch.dist}) does not shard itself for tensor "
                          "parallelism (its class does not set supports_tensor_parallel); use tensor_parallel_size=1")
    if config.parallel.pipeline_parallel_size > 1 and not getattr(arch.factory, "supports_pipeline_parallel", False):
        raise ConfigError(f"the {mc.architecture} architecture ({arch.dist}) does not build pipeline stages (its class "
                          "does not set supports_pipeline_parallel); use pipeline_parallel_size=1")
    if config.lora is not None and not getattr(arch.factory, "supports_lora", True):
        raise ConfigError(f"the {mc.architecture} architecture ({arch.dist}) does not take LoRA adapters (its class "
                          "sets supports_lora = False: a Mixture-of-Experts model's experts are not adapted yet); "
                          "drop --enable-lora")
    if mc.quantization and not getattr(arch.factory, "supports_quantization", True):
        raise ConfigError(f"the {mc.architecture} architecture ({arch.dist}) does not load quantized checkpoints "
                          f"(quantization {mc.quantization!r}; a Mixture-of-Experts model's experts are not quantized "
                          "yet); use the unquantized checkpoint")
    pm.get("pagoda_model_loaders", mc.load_format, "load_format")
    allocator = pm.get("pagoda_kv_allocators", cc.kv_allocator, "kv_allocator").factory
    scheduler_policy = pm.get("pagoda_schedulers", config.scheduler.policy, "scheduling_policy").factory
    check_policy_options(config.scheduler.policy, scheduler_policy, config.scheduler.policy_options)
    pm.get("pagoda_samplers", config.sampler, "sampler")
    check_backend_name(config, pm)
    if mc.quantization:
        pm.get("pagoda_quant_methods", mc.quantization, "quantization")
    if config.speculative is not None:
        pm.get("pagoda_proposers", config.speculative.method, "speculative_config method")
    if config.lora is not None:
        pm.get("pagoda_lora_backends", config.lora.backend, "lora_backend")
    if config.kv_connector is not None:
        pm.get("pagoda_kv_connectors", config.kv_connector.name, "kv_connector")
    executor_name = select_executor(config)
    executor_factory = pm.get("pagoda_executors", executor_name, "distributed_executor_backend").factory
    if config.parallel.tensor_parallel_size > 1:
        for name in all_reduce_candidates(config):
            pm.get("pagoda_all_reduce_backends", name, "all_reduce_backend")

    tokenizer = load_tokenizer(mc.tokenizer, mc.chat_template)
    executor = executor_factory(config, pm)  # builds the model on every rank
    runner = executor.runner
    kv_manager = adapt_component(allocator(cc, runner.num_blocks), "pagoda_kv_allocators", cc.kv_allocator)
    if runner.window_pool is not None:
        if not has_window_slots(kv_manager):
            raise ConfigError(f"the {cc.kv_allocator!r} KV allocator keeps no window slots (its class has no "
                              "init_window_pool); pass --kv-window-pool off or use kv_allocator='paged'")
        kv_manager.init_window_pool(runner.window_pool.num_slots, runner.window_pool.window)
    scheduler = build_scheduler(pm, config.scheduler, cc, kv_manager, config.lora)
    if cc.preemption_mode == "swap":
        kv_manager.init_swap_pool(runner.num_swap_blocks)
    if runner.kv_tiers is not None:
        if not has_offload_tiers(kv_manager):
            raise ConfigError(f"the {cc.kv_allocator!r} KV allocator has no offload tiers (its class has no "
                              "take_tier_moves); drop the --kv-offload-* flags or use kv_allocator='paged'")
        store = runner.kv_tiers
        kv_manager.init_offload(KVTierIndex(store.num_ram_slots, store.num_disk_blocks, store.payload_bytes,
                                            store.found))
    kv_transfers = build_kv_transfers(config, pm, runner) if config.kv_connector is not None else None
    scheduler.kv_transfers = kv_transfers
    return Components(tokenizer, runner.model, runner.backend, kv_manager, scheduler, runner, executor,
                      runner.num_blocks, eos_token_ids(mc.model, tokenizer), kv_transfers)


def build_kv_transfers(config: EngineConfig, pm: PluginManager, runner: ModelRunner) -> KVTransfers:
    """The KV connector ``config.kv_connector`` names, built with its options, and the engine's side of it."""
    kc = config.kv_connector
    factory = pm.get("pagoda_kv_connectors", kc.name, "kv_connector").factory
    try:
        connector = factory(config, **kc.options)
    except (TypeError, ValueError, OSError) as exc:
        raise ConfigError(f"the {kc.name!r} KV connector refused its options {kc.options} (--kv-connector-options): "
                          f"{exc}") from None
    identity = fingerprint(config, runner.backend, 0, 1)
    payload_bytes = block_payload_bytes(runner.kv_caches, runner.block_dim)
    logger.info("KV connector %s (role %s): blocks of %d bytes, keys %s-<block hash>", kc.name, kc.role,
                payload_bytes, identity.hex())
    return KVTransfers(connector, identity, payload_bytes, config.cache.block_size, kc.role)


# config.json model types for which AutoTokenizer, given a tokenizer_config.json that names the
# ``TokenizersBackend`` class, loads exactly that class (tests/test_tokenizer_load.py checks this against
# transformers' own tables). Others may be swapped for a model-specific class, so they go through AutoTokenizer.
PLAIN_TOKENIZER_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "granite", "olmo2", "smollm3", "phi3", "gemma", "gemma2", "gemma3_text",
    "qwen3", "qwen3_moe", "qwen2_moe", "gpt_oss"})


def plain_tokenizer_dir(path: str) -> bool:
    """Whether ``path`` is a local checkpoint whose tokenizer AutoTokenizer would load as a plain
    ``TokenizersBackend`` from its tokenizer.json: no custom code, no Mistral tekken.json, a model type
    with no tokenizer class of its own."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file() or (directory / "tekken.json").exists():
        return False
    try:
        tok_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (isinstance(tok_config, dict) and tok_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tok_config and model_type in PLAIN_TOKENIZER_MODEL_TYPES)


def load_tokenizer(path: str, chat_template: Optional[str]) -> Any:
    """The checkpoint's tokenizer, as AutoTokenizer loads it, with ``chat_template`` (when given) as its template.

    Loaded once per process for the same files and template: the engines of a process share it (a load took
    0.2-0.5 s of CPU per engine). It is read-only to them: nothing in pagoda changes a tokenizer once loaded, and
    the threads that need one of their own deep-copy it; files that change (size or modification time) are
    loaded anew."""
    directory = Path(path)
    if not directory.is_dir():
        return _load_tokenizer(path, chat_template)
    return _shared_tokenizer(str(directory.resolve()), chat_template, _files_signature(directory))


@lru_cache(maxsize=4)  # about 8 MB each (the default model's)
def _shared_tokenizer(path: str, chat_template: Optional[str], signature: tuple) -> Any:
    return _load_tokenizer(path, chat_template)


def _files_signature(directory: Path) -> tuple:
    """The name, size and modification time of each file a tokenizer may be read from in ``directory``."""
    entries = []
    for folder in (directory, directory / "additional_chat_templates"):
        try:
            with os.scandir(folder) as found:
                for entry in found:
                    if entry.is_file():
                        stat = entry.stat()
                        entries.append((entry.path, stat.st_size, stat.st_mtime_ns))
        except OSError:  # no such folder
            continue
    return tuple(sorted(entries))


def _load_tokenizer(path: str, chat_template: Optional[str]) -> Any:
    """Where AutoTokenizer would end at the plain tokenizers-library class anyway, that class is loaded
    directly: AutoTokenizer first builds the model's transformers config, whose imports
    (torch.distributed.tensor, accelerate, sympy) cost seconds of CPU in every server, replica and rank
    process."""
    try:
        if plain_tokenizer_dir(path):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(path, _from_auto=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from None
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer
