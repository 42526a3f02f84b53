"""Sizing the window pool: the K/V of the layers with a sliding window in a pool of their own, smaller than
the main one (see pagoda.kv.window for its books and docs/models.md for what it saves).

A window layer needs, per request, only the blocks its window covers, so the KV memory is split. A request
computing ``n`` tokens from position ``c`` holds the blocks of positions ``c - window + 1 .. c + n - 1``: at most
``ceil((window - 1) / block_size) + ceil(n / block_size) + 1`` blocks. As a step's ``n`` add up to at most
``max_num_batched_tokens``, the window pool gets ``max_num_seqs * (ceil((window - 1) / block_size) + 2) +
ceil(max_num_batched_tokens / block_size)`` slots (never fewer than one request's widest step), plus, with prefix
caching, the windows of a quarter of the seats for cached prefixes; the rest goes to the main pool, whose blocks
then cost only the full layers' bytes. A request not scheduled in a step keeps the window of its last step, so
a shortage can still happen: it makes requests wait or be preempted, as a shortage of main blocks does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class WindowPoolPlan:
    """How the KV memory is split when the window pool is on."""

    window: int  # the widest window of the pool's layers (it sizes the pool)
    layers: frozenset[int]  # indices of the layers whose K/V live in the pool
    num_slots: int  # slots handed out; the pool's tensors hold one more (slot 0, never written)
    num_blocks: int  # main pool blocks
    num_blocks_without: int  # main pool blocks the same memory holds without the window pool
    block_size: int

    def summary(self) -> str:
        bs = self.block_size
        return (f"{len(self.layers)} sliding-window layer(s) (window {self.window}) keep K/V in a pool of "
                f"{self.num_slots} blocks; the main pool holds {self.num_blocks * bs} tokens against "
                f"{self.num_blocks_without * bs} without it ({self.num_blocks / self.num_blocks_without:.2f}x)")


def window_pool_off_reason(config: EngineConfig) -> Optional[str]:
    """Why the window pool cannot serve this engine (None: it can)."""
    cc = config.cache
    spec = config.speculative
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline stages keep one pool each"
    if spec is not None and (spec.model or "").startswith("self:"):
        return "a self-speculation draft runs the target's layers over the main block tables"
    if cc.kv_offload_ram_bytes or cc.kv_offload_disk_dir:
        return "the --kv-offload-* tiers move whole blocks of every layer"
    if config.kv_connector is not None:
        return "a --kv-connector saves and loads whole blocks of every layer"
    return None


def plan_window_pool(config: EngineConfig, windows: dict[int, int], num_layers: int,
                     bytes_per_layer_block: int) -> Optional[WindowPoolPlan]:
    """The engine's window pool (see :func:`split_kv_memory`); None (with a log line saying why, when the model
    has window layers) where it is off, cannot serve the engine or would not save anything."""
    if config.cache.kv_window_pool == "off" or not windows:
        return None
    reason = window_pool_off_reason(config)
    if reason is not None:
        logger.info("KV window pool: off (%s); every layer keeps every token's K/V", reason)
        return None
    return split_kv_memory(config.cache, config.scheduler, windows, num_layers, bytes_per_layer_block)


def split_kv_memory(cc: CacheConfig, sc: SchedulerConfig, windows: dict[int, int], num_layers: int,
                    bytes_per_layer_block: int) -> Optional[WindowPoolPlan]:
    """The split of ``cc.kv_cache_memory_bytes`` (or of ``num_gpu_blocks_override`` main blocks) between the main
    pool and a window pool for the layers of ``windows`` (layer index -> window), a block of one layer costing
    ``bytes_per_layer_block``; None (logged) where the memory holds too little of a window pool or it saves
    nothing."""
    bs = cc.block_size
    window = max(windows.values())
    num_window, num_full = len(windows), num_layers - len(windows)
    window_blocks = -(-(window - 1) // bs)
    # one request's widest step (its step's tokens are within the budget and its length)
    span = -(-(window - 1 + min(sc.max_num_batched_tokens, sc.max_model_len)) // bs) + 1
    wanted = sc.max_num_seqs * (window_blocks + 2) + -(-sc.max_num_batched_tokens // bs)
    if cc.enable_prefix_caching:
        wanted += -(-sc.max_num_seqs // 4) * window_blocks
    wanted = max(wanted, span)
    memory = cc.kv_cache_memory_bytes
    blocks_without = cc.num_gpu_blocks_override or memory // (num_layers * bytes_per_layer_block)
    if cc.num_gpu_blocks_override:
        num_blocks = cc.num_gpu_blocks_override
        num_slots = min(wanted, num_blocks)
    else:
        num_slots = min(wanted, blocks_without)
        left = memory - (num_slots + 1) * num_window * bytes_per_layer_block
        if num_full:
            num_blocks = max(left, 0) // (num_full * bytes_per_layer_block)
        else:  # every layer has a window: the main pool is books only, room for every seat at full length
            num_blocks = max(blocks_without, sc.max_num_seqs * -(-sc.max_model_len // bs))
        num_slots = min(num_slots, num_blocks)
    if num_slots < span:
        logger.info("KV window pool: off (the KV memory holds %d window blocks, fewer than one request's widest "
                    "step of %d); every layer keeps every token's K/V", num_slots, span)
        return None
    if num_slots >= num_blocks or (not cc.num_gpu_blocks_override and num_blocks <= blocks_without):
        logger.info("KV window pool: off (%d seats' windows need %d window blocks, which leaves the main pool no "
                    "more than its %d blocks without the pool; lower --max-num-seqs or give the KV cache more "
                    "memory); every layer keeps every token's K/V", sc.max_num_seqs, wanted, blocks_without)
        return None
    return WindowPoolPlan(window, frozenset(windows), num_slots, num_blocks, blocks_without, bs)
