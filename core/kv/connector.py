"""The engine's side of a KV connector: which prompt blocks to load from outside and which to save there.

A :class:`pagoda.interfaces.KVConnector` (the ``pagoda_kv_connectors`` component) is a store of opaque byte
strings by key. :class:`KVTransfers` is everything around it, owned by the scheduler, plain Python over block
hashes and bytes:

- at admission the scheduler asks :meth:`KVTransfers.blocks_for` which of a request's full prompt blocks,
  beyond those its own prefix cache holds, come from the store. The first time, that asks the connector's
  ``lookup`` and starts reading the blocks it has on connector threads; the request waits (other requests go
  on stepping) until every read has ended. Each value is then checked (:func:`decode_block`: its framing,
  the configuration's fingerprint, the block's hash and tokens, its length and crc32); the verified blocks
  from the first on are handed to the step (``SchedulerOutput.kv_connector.loads``) and the runner copies them
  into the request's fresh cache blocks before the forward pass. A block missing or failing its check, and
  every block after it, is simply computed: the request's tokens do not change.
- when a step completes a request's prompt, its full prompt blocks go in ``SchedulerOutput.kv_connector.saves``;
  the runner copies their bytes out after the forward pass (``RunnerOutput.kv_saved``) and :meth:`save` frames
  and writes them on connector threads, off the step (a prefill instance, role ``prefill``, waits for them
  before its step ends, so that its answer means the blocks are in the store).

A stored value (the same layout as an offload-tier block file, another magic)::

    header   magic "PGKC", format version, token count, has a parent, fingerprint, block hash, parent hash,
             payload bytes
    tokens   int64 [block_size]
    payload  every layer's slice of the block, in cache order, raw bytes
    crc32    of everything above
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagoda.kv.blocks import hash_block
from pagoda.sequence import Sequence
from pagoda.step import BlockKey, SchedulerOutput

logger = logging.getLogger("pagoda")

MAGIC = b"PGKC"
FORMAT_VERSION = 1
# magic, format version, token count, has a parent, fingerprint, block hash, parent hash, payload bytes
_HEADER = struct.Struct("<4sHHB16sqqQ")
_CRC = struct.Struct("<I")
# block hashes this engine saved or loaded lately: not saved again
_KNOWN_BLOCKS = 1 << 16


def block_key(identity: bytes, block_hash: int) -> str:
    """The connector key of a block: ``<fingerprint hex>-<chain hash as 16 hex digits>``."""
    return f"{identity.hex()}-{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"


def encode_block(identity: bytes, block_hash: int, key: BlockKey, payload: bytes) -> bytes:
    """A block's payload framed with what identifies it and a crc32 (see the module docstring)."""
    parent, tokens, _ = key
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(tokens), parent is not None, identity, block_hash,
                          parent if parent is not None else 0, len(payload))
    body = header + struct.pack(f"<{len(tokens)}q", *tokens)
    crc = zlib.crc32(payload, zlib.crc32(body))
    return b"".join((body, payload, _CRC.pack(crc)))


def decode_block(value: Any, identity: bytes, block_hash: int, key: BlockKey, payload_bytes: int
                 ) -> Optional[memoryview]:
    """The payload of a stored value if it is exactly this block of this configuration, whole; else None."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        return None
    data = memoryview(value).cast("B")
    parent, tokens, _ = key
    size = _HEADER.size + 8 * len(tokens) + payload_bytes + _CRC.size
    if len(data) != size:
        return None  # short (a transfer cut off) or of another shape
    expected = (MAGIC, FORMAT_VERSION, len(tokens), parent is not None, identity, block_hash,
                parent if parent is not None else 0, payload_bytes)
    if _HEADER.unpack_from(data) != expected:
        return None
    if struct.unpack_from(f"<{len(tokens)}q", data, _HEADER.size) != tuple(tokens):
        return None  # another block under the same 64-bit hash
    if zlib.crc32(data[:-_CRC.size]) != _CRC.unpack_from(data, size - _CRC.size)[0]:
        return None
    start = _HEADER.size + 8 * len(tokens)
    return data[start:start + payload_bytes]


@dataclass
class KVConnectorStats:
    lookups: int = 0  # requests whose prompt blocks were looked up in the store
    blocks_found: int = 0  # blocks the store said it holds
    blocks_loaded: int = 0  # blocks loaded into the cache instead of computed
    blocks_failed: int = 0  # blocks found but missing, unreadable or failing their check when read: computed
    blocks_saved: int = 0  # blocks written to the store
    save_errors: int = 0  # saves the connector raised on (the block is simply not in the store)
    bytes_loaded: int = 0
    bytes_saved: int = 0


class KVTransfers:
    """The scheduler's side of a connector (see the module docstring). ``role``: ``both``, ``prefill`` (save
    only) or ``decode`` (load only)."""

    def __init__(self, connector: Any, identity: bytes, payload_bytes: int, block_size: int, role: str = "both",
                 num_threads: int = 4) -> None:
        self.connector = connector
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.block_size = block_size
        self.loads_blocks = role in ("both", "decode")
        self.saves_blocks = role in ("both", "prefill")
        # a prefill instance's step waits for its saves (written in parallel), so that its answer, which sends
        # the request on to a decode instance, comes once the blocks are there to load
        self.waits_for_saves = role == "prefill"
        self.stats = KVConnectorStats()
        # request id -> (block hash, key) of its full prompt blocks, in order
        self._chains: dict[str, list[tuple[int, BlockKey]]] = {}
        # request id -> block hash -> the read of its value (verified payload or None), for requests waiting
        self._loads: dict[str, dict[int, Future]] = {}
        self._asked: set[str] = set()  # requests looked up already (each is, once)
        self._known: OrderedDict[int, None] = OrderedDict()  # blocks in the store as far as this engine knows
        self._save_keys: dict[int, BlockKey] = {}  # blocks in a step's saves, until their bytes come back
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pagoda-kv-connector")
        self._saves: set[Future] = set()
        self._lock = threading.Lock()
        self._load_done = threading.Condition()
        self._closed = False

    # ---- loads (at admission) -------------------------------------------------------------------------

    def blocks_for(self, request: Sequence, num_cached: int) -> Optional[list[tuple[int, memoryview]]]:
        """The verified payloads of the request's full prompt blocks that follow its first ``num_cached``
        tokens (the prefix cache's hits), in order, to load instead of compute; ``[]`` if none; None while
        reads of them are still running (the request waits this step)."""
        if not self._may_load(request):
            return []
        rid, bs = request.request_id, self.block_size
        first, end = num_cached // bs, (request.num_tokens - 1) // bs  # (one token is always computed)
        reads = self._loads.get(rid)
        if reads is None:
            if rid in self._asked or first >= end:
                return []
            self._asked.add(rid)
            wanted = self._chain(request)[first:end]
            num_found = self._lookup([block_key(self.identity, h) for h, _ in wanted])
            if not num_found:
                return []
            self.stats.lookups += 1
            self.stats.blocks_found += num_found
            self._loads[rid] = {h: self._pool.submit(self._read, h, key) for h, key in wanted[:num_found]}
            return None
        if not all(f.done() for f in reads.values()):
            return None
        found = []
        for block_hash, _ in self._chain(request)[first:end]:
            read = reads.get(block_hash)
            payload = read.result() if read is not None else None
            if payload is None:
                break
            found.append((block_hash, payload))
        return found

    def admitted(self, request: Sequence, num_loaded: int) -> None:
        """The request started with ``num_loaded`` of the blocks :meth:`blocks_for` gave: its reads are done
        with (the others of them, failed or past a failure, are computed)."""
        reads = self._loads.pop(request.request_id, None)
        if reads is None:
            return
        self.stats.blocks_loaded += num_loaded
        self.stats.bytes_loaded += num_loaded * self.payload_bytes
        failed = sum(1 for f in reads.values() if f.result() is None)
        self.stats.blocks_failed += failed
        for block_hash, read in reads.items():
            if read.result() is not None:
                self._remember(block_hash)

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def wait_for_loads(self, timeout: float) -> None:
        """Wait until a read ends or ``timeout`` seconds pass (an engine whose every request waits on reads)."""
        with self._load_done:
            if any(not f.done() for reads in self._loads.values() for f in reads.values()):
                self._load_done.wait(timeout)

    def _may_load(self, request: Sequence) -> bool:
        return (self.loads_blocks and request.num_computed_tokens == 0 and request.num_output_tokens == 0
                and request.lora_request is None and request.sampling_params.prompt_logprobs is None)

    def _lookup(self, keys: list[str]) -> int:
        try:
            num_found = int(self.connector.lookup(keys))
        except Exception as exc:  # noqa: BLE001 - a store that is down costs a recompute, not the request
            logger.warning("KV connector: lookup of %d blocks failed (%s: %s); computing them", len(keys),
                           type(exc).__name__, exc)
            return 0
        return max(0, min(num_found, len(keys)))

    def _read(self, block_hash: int, key: BlockKey) -> Optional[memoryview]:
        """On a connector thread: the block's verified payload, or None."""
        try:
            value = self.connector.load(block_key(self.identity, block_hash))
            return None if value is None else decode_block(value, self.identity, block_hash, key,
                                                           self.payload_bytes)
        except Exception as exc:  # noqa: BLE001
            logger.warning("KV connector: loading block %016x failed (%s: %s); computing it",
                           block_hash & 0xFFFFFFFFFFFFFFFF, type(exc).__name__, exc)
            return None
        finally:
            with self._load_done:
                self._load_done.notify_all()

    # ---- saves (a finished prefill) -------------------------------------------------------------------

    def note_scheduled(self, out: SchedulerOutput, request: Sequence, num_computed: int, num_new: int,
                       block_table: list[int]) -> None:
        """A request was put in the step: if the step completes its prompt, save its full prompt blocks that
        the store does not hold yet (the runner reads them after the forward pass)."""
        if (not self.saves_blocks or request.num_output_tokens or request.lora_request is not None
                or num_computed + num_new < request.num_prompt_tokens):
            return
        chain = self._chain(request)[:request.num_prompt_tokens // self.block_size]
        for i, (block_hash, key) in enumerate(chain):
            if block_hash in self._known or block_hash in self._save_keys:
                continue
            self._save_keys[block_hash] = key
            out.kv_connector.saves.append((block_table[i], block_hash))

    def save(self, sched: SchedulerOutput, saved: list[tuple[int, Any]]) -> None:
        """The bytes of the step's saved blocks (``RunnerOutput.kv_saved``): framed and written off the step.
        Blocks of the step's saves that did not come back (a step run again in parts) are not saved."""
        payloads = dict(saved)
        written = []
        for _, block_hash in sched.kv_connector.saves:
            key = self._save_keys.pop(block_hash, None)
            payload = payloads.get(block_hash)
            if key is None or payload is None or self._closed:
                continue
            self._remember(block_hash)
            future = self._pool.submit(self._write, block_hash, key, payload)
            with self._lock:
                self._saves.add(future)
            future.add_done_callback(self._save_done)
            written.append(future)
        if self.waits_for_saves:
            for future in written:  # a prefill instance answers once its blocks are in the store
                future.result()

    def drop_saves(self, sched: SchedulerOutput) -> None:
        """A step that did not run to the end: its saves are not coming."""
        for _, block_hash in sched.kv_connector.saves:
            self._save_keys.pop(block_hash, None)

    def _write(self, block_hash: int, key: BlockKey, payload: Any) -> None:
        value = encode_block(self.identity, block_hash, key, payload)
        try:
            self.connector.save(block_key(self.identity, block_hash), value)
        except Exception as exc:  # noqa: BLE001 - the block is not in the store: a later prefill saves it
            logger.warning("KV connector: saving block %016x failed (%s: %s)", block_hash & 0xFFFFFFFFFFFFFFFF,
                           type(exc).__name__, exc)
            with self._lock:
                self.stats.save_errors += 1
                self._known.pop(block_hash, None)
            return
        with self._lock:
            self.stats.blocks_saved += 1
            self.stats.bytes_saved += len(payload)

    def _save_done(self, future: Future) -> None:
        with self._lock:
            self._saves.discard(future)

    # ---- requests ------------------------------------------------------------------------------------

    def forget(self, request: Sequence) -> None:
        """The request ended (or lost its blocks for good): drop what was kept for it."""
        rid = request.request_id
        self._chains.pop(rid, None)
        self._asked.discard(rid)
        self._loads.pop(rid, None)

    def _chain(self, request: Sequence) -> list[tuple[int, BlockKey]]:
        """(chain hash, key) of each full block of the request's prompt, as the prefix cache hashes them."""
        chain = self._chains.get(request.request_id)
        if chain is None:
            tokens, bs = request.all_token_ids, self.block_size
            chain, parent = [], None
            for i in range(request.num_prompt_tokens // bs):
                key = (parent, tuple(tokens[i * bs:(i + 1) * bs]), ())
                parent = hash_block(*key)
                chain.append((parent, key))
            self._chains[request.request_id] = chain
        return chain

    def _remember(self, block_hash: int) -> None:
        with self._lock:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
            while len(self._known) > _KNOWN_BLOCKS:
                self._known.popitem(last=False)

    # ---- the end ---------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every save queued so far."""
        with self._lock:
            pending = list(self._saves)
        for future in pending:
            future.result()

    def close(self) -> None:
        """Finish the queued saves, stop the threads and close the connector."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.connector.close()


# ---- the runner's side: a block's bytes in and out of the cache --------------------------------------------


def block_payload_bytes(caches: list[torch.Tensor], block_dim: int) -> int:
    """Bytes of one block across every layer's cache tensor."""
    return sum(c.select(block_dim, 0).numel() * c.element_size() for c in caches)


def read_block(caches: list[torch.Tensor], block_dim: int, block: int) -> bytes:
    """Every layer's slice of cache block ``block``, in cache order, as bytes."""
    return b"".join(c.select(block_dim, block).contiguous().cpu().view(torch.uint8).numpy().tobytes()
                    for c in caches)


def write_block(caches: list[torch.Tensor], block_dim: int, block: int, payload: Any) -> None:
    """A payload of :func:`read_block`'s layout into cache block ``block``."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for cache in caches:
        target = cache.select(block_dim, block)
        n = target.numel() * cache.element_size()
        target.copy_(data[offset:offset + n].view(cache.dtype).view(target.shape))
        offset += n
