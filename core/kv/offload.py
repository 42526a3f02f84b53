"""The runner's side of the KV offload tiers: CPU-RAM copies of evicted prefix blocks, and one checksummed
file per block on disk.

Keeps no books: the allocator's :class:`~pagoda.kv.tiers.KVTierIndex` decides every move and the step
carries them here (:class:`~pagoda.kv.tiers.KVTierMoves`). A block file is::

    header (magic, format version, token count, fingerprint, block hash, parent hash, payload bytes)
    token ids              int64 [block_size]
    payload                every layer's slice of the block, in cache order, raw bytes
    crc32                  of everything above, uint32

A file that is short, has another header, or fails its crc32 is deleted and reported, never copied into
the cache. Files live under ``DIR/pagoda-kv-<fingerprint>/``: the fingerprint covers what makes K/V differ
(the model, its dtype, the KV dtype and layout, the block size, the tensor-parallel rank and size), so an
engine never reads another configuration's blocks, and one started again on the same directory finds the
blocks the last one wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.host.dtypes import stored_kv_dtype
from pagoda.step import BlockKey, KVTierMoves

logger = logging.getLogger("pagoda")

MAGIC = b"PGKV"
FORMAT_VERSION = 1
# magic, format version, token count, has a parent, fingerprint, block hash, parent hash, payload bytes
_HEADER = struct.Struct("<4sHHB16sqqQ")
_CRC = struct.Struct("<I")


def fingerprint(config: Any, backend: Any, rank: int, size: int) -> bytes:
    """16 bytes naming everything a block's K/V depends on besides its tokens."""
    mc, cc = config.model, config.cache
    kv_dtype = stored_kv_dtype(backend, mc.dtype)
    files = [*Path(mc.model).glob("*.safetensors"), *Path(mc.model).glob("*.bin"), *Path(mc.model).glob("*.pt")]
    weights = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files)
    identity = {
        "format": FORMAT_VERSION, "model": str(Path(mc.model).resolve()), "weights": weights,
        "hf_config": mc.hf_config, "dtype": str(mc.dtype), "kv_dtype": str(kv_dtype),
        "kv_cache_dtype": cc.kv_cache_dtype, "quantization": mc.quantization, "block_size": cc.block_size,
        "layout": list(backend.kv_cache_shape(1)), "backend": type(backend).__name__, "rank": rank, "size": size,
        "load_format": mc.load_format, "seed": mc.seed,  # random ("dummy") weights differ by seed
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class KVTierStore:
    """RAM slots laid out like the cache (``num_ram_slots`` along its block axis) and a directory of block
    files; performs a step's :class:`KVTierMoves` on ``caches`` (every layer's KV tensor)."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int, block_size: int, num_ram_slots: int,
                 disk_dir: Optional[str], num_disk_blocks: int, identity: bytes) -> None:
        self.caches = [_raw_bytes(c) for c in caches]
        self.block_dim = block_dim
        self.block_size = block_size
        self.identity = identity
        self.num_ram_slots = num_ram_slots
        # untouched pages of an empty CPU tensor take no memory: the RAM tier fills as blocks arrive
        self.ram = [_cpu_blocks(c, block_dim, num_ram_slots) for c in self.caches]
        self.payload_bytes = sum(c.select(block_dim, 0).numel() * c.element_size() for c in self.caches)
        self.file_bytes = _HEADER.size + 8 * block_size + self.payload_bytes + _CRC.size
        self.num_disk_blocks = num_disk_blocks
        self.dir: Optional[Path] = None
        if disk_dir is not None:
            self.dir = Path(disk_dir) / f"pagoda-kv-{identity.hex()}"
            self.dir.mkdir(exist_ok=True)
        # (block hash, key) of the files a previous engine left, oldest first
        self.found = self.scan()
        # file writes and deletes run in order on one thread, off the step; reads in parallel, in the step.
        # The threads start on first use (none without a disk tier).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pagoda-kv-write")
        self._readers = ThreadPoolExecutor(4, thread_name_prefix="pagoda-kv-read")
        self._pending: dict[int, Future] = {}  # block hash -> its last queued write or delete

    # ---- a step's moves ------------------------------------------------------------------------------

    def apply(self, moves: KVTierMoves) -> list[int]:
        """Perform the moves in :class:`KVTierMoves` order; returns the block hashes whose files failed
        their check (deleted, not loaded: their blocks hold nothing valid)."""
        for block_hash in moves.files_to_delete:
            self._queue(block_hash, self._path(block_hash).unlink, True)
        for slot, block_hash, key in moves.ram_to_disk:
            self._queue_write(block_hash, key, [r.select(self.block_dim, slot) for r in self.ram])
        self._copy(moves.blocks_to_ram, self.caches, self.ram)
        for block, block_hash, key in moves.blocks_to_disk:
            self._queue_write(block_hash, key, [c.select(self.block_dim, block) for c in self.caches])
        self._copy(moves.ram_to_blocks, self.ram, self.caches)
        loads = moves.disk_to_blocks
        for block_hash, _ in loads:
            self._wait(block_hash)  # a file written a moment ago is read once it is whole
        payloads = list(self._readers.map(self._read_verified, [h for h, _ in loads]))
        failed = []
        for (block_hash, block), payload in zip(loads, payloads):
            if payload is None:
                failed.append(block_hash)
            else:
                self._copy_in(payload, block)
        return failed

    def discard(self, block_hashes: list[int]) -> None:
        """Delete these blocks' files (another rank found its copy corrupt: every rank recomputes)."""
        for block_hash in block_hashes:
            self._queue(block_hash, self._path(block_hash).unlink, True)

    def flush(self) -> None:
        """Wait for every queued file write and delete (an engine that stops leaves whole files)."""
        for block_hash in list(self._pending):
            self._wait(block_hash)

    def _copy(self, pairs: list[tuple[int, int]], sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
        for source, target in zip(sources, targets):
            target.index_copy_(self.block_dim, dst.to(target.device),
                               source.index_select(self.block_dim, src.to(source.device)).to(target.device))

    # ---- files ----------------------------------------------------------------------------------------

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}.kv"

    def _queue(self, block_hash: int, fn: Any, *args: Any) -> None:
        if len(self._pending) > 4096:  # forget the finished ones
            self._pending = {h: f for h, f in self._pending.items() if not f.done()}
        self._pending[block_hash] = self._writer.submit(fn, *args)

    def _wait(self, block_hash: int) -> None:
        future = self._pending.pop(block_hash, None)
        if future is not None:
            future.result()

    def _queue_write(self, block_hash: int, key: BlockKey, layers: list[torch.Tensor]) -> None:
        # the block's bytes are copied now (its slot or pool block may be overwritten this step); the file
        # is written on the writer thread
        payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8).cpu() for t in layers]).numpy()
        self._queue(block_hash, self._write, block_hash, key, payload)

    def _write(self, block_hash: int, key: BlockKey, payload: Any) -> None:
        try:
            self._write_file(block_hash, key, payload)
        except OSError as exc:  # a full disk loses this block only: a later load finds no file and recomputes
            logger.warning("KV offload: cannot write block file %s: %s", self._path(block_hash), exc)
            self._path(block_hash).with_suffix(".tmp").unlink(missing_ok=True)

    def _write_file(self, block_hash: int, key: BlockKey, payload: Any) -> None:
        parent, tokens, _ = key
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(tokens), parent is not None, self.identity, block_hash,
                              parent if parent is not None else 0, len(payload))
        body = header + struct.pack(f"<{len(tokens)}q", *tokens)
        crc = zlib.crc32(payload, zlib.crc32(body))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.write(memoryview(payload))
            f.write(_CRC.pack(crc))
        os.replace(tmp, path)  # a crash mid-write never leaves a partial file under the block's name

    def _read_verified(self, block_hash: int) -> Optional[bytearray]:
        """A block file's payload (on a reader thread); None, the file deleted, if it is missing, short, of
        another block or configuration, or fails its crc32."""
        path = self._path(block_hash)
        try:
            data = bytearray(path.read_bytes())
        except FileNotFoundError:
            return None
        parsed = self._parse_header(data)
        ok = (parsed is not None and parsed[0] == block_hash and len(data) == self.file_bytes
              and zlib.crc32(memoryview(data)[:-_CRC.size]) == _CRC.unpack_from(data, len(data) - _CRC.size)[0])
        if not ok:
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # the file's time is its place in the LRU order when an engine starts on the directory
        start = _HEADER.size + 8 * self.block_size
        return data[start:start + self.payload_bytes]

    def _copy_in(self, data: bytearray, block: int) -> None:
        """A verified payload into cache block ``block``, layer by layer."""
        payload = torch.frombuffer(data, dtype=torch.uint8)
        offset = 0
        for cache in self.caches:
            target = cache.select(self.block_dim, block)
            n = target.numel() * cache.element_size()
            target.copy_(payload[offset:offset + n].view(cache.dtype).view(target.shape))
            offset += n

    def _parse_header(self, data: bytes) -> Optional[tuple[int, BlockKey]]:
        """``(block hash, key)`` from a file's start if it is a block file of this configuration."""
        if len(data) < _HEADER.size + 8 * self.block_size:
            return None
        magic, version, num_tokens, has_parent, identity, block_hash, parent, payload = _HEADER.unpack_from(data)
        if (magic, version, num_tokens, identity, payload) != (MAGIC, FORMAT_VERSION, self.block_size,
                                                               self.identity, self.payload_bytes):
            return None
        tokens = struct.unpack_from(f"<{num_tokens}q", data, _HEADER.size)
        return block_hash, (parent if has_parent else None, tokens, ())

    def scan(self) -> list[tuple[int, BlockKey]]:
        """The blocks already in the directory, oldest first, for the allocator's index. Leftover temporary
        files, files of another shape, and the oldest files beyond ``num_disk_blocks`` are deleted."""
        if self.dir is None:
            return []
        entries = []
        for path in self.dir.iterdir():
            if path.suffix != ".kv":
                path.unlink(missing_ok=True)
                continue
            with open(path, "rb") as f:
                parsed = self._parse_header(f.read(_HEADER.size + 8 * self.block_size))
            if parsed is None or path.stat().st_size != self.file_bytes or path != self._path(parsed[0]):
                path.unlink(missing_ok=True)  # (a corrupt payload is found when the block is loaded)
                continue
            entries.append((path.stat().st_mtime_ns, path, parsed))
        entries.sort(key=lambda e: e[0])
        excess = max(0, len(entries) - self.num_disk_blocks)
        for _, path, _ in entries[:excess]:
            path.unlink(missing_ok=True)
        return [parsed for _, _, parsed in entries[excess:]]


def _cpu_blocks(cache: torch.Tensor, block_dim: int, num_blocks: int) -> torch.Tensor:
    """A CPU tensor laid out like ``cache`` with ``num_blocks`` along its block axis."""
    shape = list(cache.shape)
    shape[block_dim] = num_blocks
    return torch.empty(shape, dtype=cache.dtype, device="cpu")


def _raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte (fp8) cache seen as uint8 (index_copy_ has no fp8 kernel on a CPU); others unchanged."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.is_floating_point() else cache
