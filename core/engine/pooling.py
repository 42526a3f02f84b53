"""Pooling models: embeddings and cross-encoder scores, prefill-only.

A :class:`PoolingEngine` runs a pooling model over batches of tokenized inputs and returns one vector (embed)
or one score (score) per input: no decode, no sampling. An encoder (BERT family) runs its batch packed, with
no padding, bidirectional attention and no KV cache; a decoder used for embeddings runs through pagoda's own decoder and
attention backend in blocks of its engine's KV pool (with last-token pooling, prefixes cached by earlier
inputs are reused). :class:`AsyncPoolingEngine` puts the server's requests into shared batches on a thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.modeling.pooling import TASKS, detect_task, is_encoder, pool, pool_packed, read_pooling_config

logger = logging.getLogger("pagoda.pooling")

DEFAULT_MAX_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class PoolingInput:
    """One input of a pooling request: its token ids and, for an encoder's text pairs, its token types."""

    token_ids: list[int]
    token_type_ids: Optional[list[int]] = None


def resolve_serving_task(model: str, task: str, runner: Optional[str]) -> str:
    """The task a model runs for, from ``task`` (``--task``) and vLLM's ``runner`` (``--runner``)."""
    if runner not in (None, "auto", "generate", "pooling"):
        raise ConfigError(f"--runner {runner!r}: choose generate or pooling")
    if runner == "generate":
        if task not in ("auto", "generate"):
            raise ConfigError(f"--runner generate and --task {task} disagree; give one of them")
        task = "generate"
    resolved = resolve_task(str(model), task)
    if runner == "pooling" and resolved == "generate":
        if task == "generate":
            raise ConfigError("--runner pooling and --task generate disagree; give one of them")
        resolved = "embed"
    return resolved


def resolve_task(model_dir: str, task: str) -> str:
    """``--task``: ``auto`` reads the checkpoint (see :func:`~pagoda.modeling.pooling.detect_task`)."""
    if task not in ("auto", *TASKS):
        raise ConfigError(f"--task {task!r}: choose one of auto, {', '.join(TASKS)}")
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        if task in ("auto", "generate"):
            return "generate"
        raise ConfigError(f"--task {task} needs a checkpoint folder with a config.json; {model_dir} has none")
    hf_config = json.loads(cfg_path.read_text())
    detected = detect_task(model_dir, hf_config)
    if task == "auto":
        return detected
    if task == "generate" and is_encoder(hf_config):
        raise ConfigError(f"{model_dir} is an encoder ({hf_config['architectures'][0]}), which cannot generate "
                          f"text; serve it with --task {detected}")
    return task


class PoolingEngine:
    """A pooling model, its tokenizer and its batching. ``task``: ``embed`` (one vector per input) or ``score``
    (a cross-encoder: one score per text pair; an embedding model scores pairs by the cosine of their
    embeddings)."""

    def __init__(self, args: Any, task: str, plugin_manager: Any = None) -> None:
        from pagoda.engine.components import load_tokenizer
        from pagoda.registry.plugin_manager import get_plugin_manager

        self.pm = plugin_manager or get_plugin_manager()
        self.model_dir = model_dir = str(args.model)
        self.hf_config = hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.task = task
        self.pooling = read_pooling_config(model_dir, hf_config)
        self.served_model_name = args.served_model_name or model_dir
        self.max_batch_tokens = args.max_num_batched_tokens or DEFAULT_MAX_BATCH_TOKENS
        self.encoder = None
        self.llm_engine = None
        if is_encoder(hf_config):
            from pagoda.modeling.models.bert import EncoderModel

            from pagoda.host.dtypes import cpu_has_bf16

            # auto: bf16 where the CPU multiplies bf16 natively (AVX-512 BF16: about 1.9x float32's speed on
            # BERT-base), float32 elsewhere (bf16 linears run about 6x slower than float32 without it)
            host = args.host_config()
            auto = torch.bfloat16 if cpu_has_bf16(host.cpu_isa) else torch.float32
            dtype = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}.get(args.dtype)
            if dtype is None:
                raise ConfigError(f"--dtype {args.dtype!r}: an encoder runs in float32, bfloat16 or float16")
            self.encoder = EncoderModel.from_checkpoint(model_dir, hf_config, dtype, host)
            self.tokenizer = load_tokenizer(args.tokenizer or model_dir, None)
            self.vocab_size = int(hf_config["vocab_size"])
            self.hidden_size = self.encoder.hidden_size
            limit = self.encoder.max_positions
            if task == "score" and self.encoder.num_labels > 1:
                raise ConfigError(f"{model_dir}: a cross-encoder scores with one label; this one has "
                                  f"{self.encoder.num_labels} (num_labels in config.json)")
        else:
            from pagoda.engine.llm_engine import LLMEngine

            self.llm_engine = LLMEngine(args.create_engine_config(), self.pm)
            if self.llm_engine.runner is None or self.llm_engine.config.parallel.tensor_parallel_size != 1:
                raise ConfigError("a decoder pooling model runs in one process: drop --tensor-parallel-size "
                                  "and --pipeline-parallel-size")
            self.tokenizer = self.llm_engine.tokenizer
            mc = self.llm_engine.config.model
            self.vocab_size, self.hidden_size, limit = mc.vocab_size, mc.hidden_size, mc.max_model_len
            self.block_size = self.llm_engine.config.cache.block_size
        if args.max_model_len:
            limit = min(limit, args.max_model_len)
        self.max_model_len = min(limit, self.pooling.max_seq_length or limit)
        self.max_batch_tokens = max(self.max_batch_tokens, self.max_model_len)
        if self.llm_engine is not None:  # a batch's inputs all fit in the KV pool at once
            self.max_batch_tokens = min(self.max_batch_tokens, self.llm_engine.num_blocks * self.block_size)
        self.lock = threading.Lock()  # one batch at a time runs the model
        self._request_ids = itertools.count()
        self.num_cached_tokens = 0  # a decoder's input tokens found in the prefix cache, since start

    # ---- inputs -------------------------------------------------------------------------------------------

    def check(self, item: PoolingInput, param: str) -> None:
        """Refuse an input the model cannot take, naming the field ``param``."""
        n = len(item.token_ids)
        if n == 0:
            raise InvalidRequestError(f"{param}: an input has no tokens; send non-empty text or token ids",
                                      param=param)
        if n > self.max_model_len:
            raise InvalidRequestError(f"{param}: an input has {n} tokens, more than the model's {self.max_model_len}"
                                      "; shorten it or split it into several inputs", param=param)
        bad = [t for t in item.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, "
                                      f"{self.vocab_size})", param=param)

    def tokenize(self, text: str) -> PoolingInput:
        return PoolingInput(list(self.tokenizer(text, add_special_tokens=True)["input_ids"]))

    def tokenize_pair(self, first: str, second: str) -> PoolingInput:
        enc = self.tokenizer(first, second, add_special_tokens=True)
        types = enc.get("token_type_ids")
        return PoolingInput(list(enc["input_ids"]), list(types) if types is not None else None)

    # ---- running ------------------------------------------------------------------------------------------

    def batch_cost(self, items: list[PoolingInput]) -> int:
        """Tokens a batch costs: an encoder packs its inputs (no padding); a decoder takes whole KV blocks."""
        if self.encoder is not None:
            return sum(len(i.token_ids) for i in items)
        return sum(-(-len(i.token_ids) // self.block_size) * self.block_size for i in items)

    @torch.inference_mode()
    def run(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """One batch: per input its pooled vector ``[hidden]`` (embed; not normalized, see
        :func:`~pagoda.modeling.pooling.finish_embedding`) or its score ``[]`` (a cross-encoder's)."""
        with self.lock:
            if self.encoder is not None:
                return self._run_encoder(items)
            return self._run_decoder(items)

    def _run_encoder(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        # packed end to end, longest first: inputs of one length lie together and attend in one call
        order = sorted(range(len(items)), key=lambda i: -len(items[i].token_ids))
        ordered = [items[i] for i in order]
        lengths = [len(i.token_ids) for i in ordered]
        input_ids = torch.tensor([t for i in ordered for t in i.token_ids])
        token_types = torch.zeros(len(input_ids), dtype=torch.long)
        start = 0
        for item, n in zip(ordered, lengths):
            if item.token_type_ids is not None:
                token_types[start:start + len(item.token_type_ids)] = torch.tensor(item.token_type_ids)
            start += n
        hidden = self.encoder(input_ids, token_types, lengths)  # [tokens, hidden]
        if self.task == "score" and self.encoder.num_labels:
            firsts = hidden[torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)]
            out = torch.sigmoid(self.encoder.classify(firsts).float()[:, 0])
        else:
            out = pool_packed(hidden, lengths, self.pooling.method)
        results: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for row, i in enumerate(order):
            results[i] = out[row]
        return results

    def _run_decoder(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """The batch's inputs in blocks of the engine's KV pool. With last-token pooling and prefix caching, an
        input whose first full blocks are cached (an earlier input's prefix: a shared instruction or document
        head) computes only the rest; its blocks stay cached when the batch ends. Other poolings need every
        token's hidden state, so they compute every token."""
        from pagoda.execution.model_runner import FlatBatch
        from pagoda.interfaces import has_offload_tiers
        from pagoda.sampling_params import SamplingParams
        from pagoda.sequence import Sequence

        kv = self.llm_engine.kv_manager
        # (a hit in an offload tier would need the runner to load it first: only blocks in the pool are reused)
        reuse = (self.pooling.method == "last" and getattr(kv, "enable_prefix_caching", False)
                 and not (has_offload_tiers(kv) and kv.tiers is not None))
        params = SamplingParams(max_tokens=1)  # (what a request needs to be looked up; nothing is sampled)
        seqs: list[Sequence] = []
        pieces, starts, tables = [], [], []
        try:
            for item in items:
                seq = Sequence(f"pool-{next(self._request_ids)}", list(item.token_ids), params)
                hits, cached = kv.get_computed_blocks(seq) if reuse else ([], 0)
                if not kv.allocate_slots(seq, len(item.token_ids) - cached, hits):
                    # (batches are cut to the pool's size and nothing else holds blocks: not reached)
                    raise RuntimeError(f"the KV pool has no room for a batch of {self.batch_cost(items)} tokens")
                seqs.append(seq)
                pieces.append(item.token_ids[cached:])
                starts.append(cached)
                tables.append(kv.block_table(seq.request_id))
                self.num_cached_tokens += cached
            kv.take_block_copies()  # (none: hits are full blocks, new tokens go to fresh ones)
            batch = FlatBatch(pieces, starts, tables, self.block_size)
            hidden = self.llm_engine.runner.forward(batch)  # [num_tokens, hidden], the batch's row order
        finally:
            for seq in seqs:
                kv.free(seq)
        out = []
        for row, item in enumerate(items):
            rows = hidden[batch.rows(row).start:batch.rows(row).stop]  # [new tokens, hidden]
            out.append(pool(rows[None], torch.tensor([len(rows)]), self.pooling.method)[0])
        return out

    @property
    def scores_pairs_itself(self) -> bool:
        """Whether a text pair is scored by the model itself (a cross-encoder's head), else by the cosine of the
        two texts' embeddings."""
        return self.task == "score" and self.encoder is not None and bool(self.encoder.num_labels)

    def shutdown(self) -> None:
        """Stop a decoder's engine (an encoder holds nothing to stop)."""
        if self.llm_engine is not None:
            self.llm_engine.shutdown()

    def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Every input, in batches of at most ``max_batch_tokens`` (offline use and benchmarks)."""
        results: list[torch.Tensor] = []
        start = 0
        while start < len(items):
            end = start + 1
            while end < len(items) and self.batch_cost(items[start:end + 1]) <= self.max_batch_tokens:
                end += 1
            results.extend(self.run(items[start:end]))
            start = end
        return results


class PoolingStats:
    """What ``/metrics`` shows of a pooling server, counting each input as one request (as the engine runs it).
    ``num_prompt_tokens`` is written on the event loop, everything else on the engine's thread (and by
    ``shutdown`` once that thread has stopped taking batches)."""

    def __init__(self) -> None:
        from pagoda.engine.metrics import REQUEST_LATENCY_BUCKETS, Histogram

        self.num_prompt_tokens = 0
        self.num_steps = 0  # batches run
        self.step_seconds = 0.0
        self.finished_by_reason: collections.Counter = collections.Counter()  # stop, error, abort
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)


class AsyncPoolingEngine:
    """A :class:`PoolingEngine` serving asyncio callers: the inputs of every waiting request are gathered into
    shared batches (in arrival order, up to the engine's token budget) and run on the engine's thread. A batch
    that fails is run again one input at a time, so only the input that fails gets the error."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self.stats = PoolingStats()
        self._pending: collections.deque = collections.deque()  # (input, future, arrival time)
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = False
        self._num_running = 0
        self.dead_reason: Optional[str] = None

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._loop = loop or asyncio.get_event_loop()
        self._thread = threading.Thread(target=self._serve, name="pagoda-pooling", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and not self._stopping and self._thread is not None \
            and self._thread.is_alive()

    async def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        if not self.is_healthy:
            from pagoda.engine.async_engine import EngineDeadError

            raise EngineDeadError(f"the engine cannot serve: {self.dead_reason or 'the server is shutting down'}")
        futures = [concurrent.futures.Future() for _ in items]
        self.stats.num_prompt_tokens += sum(len(i.token_ids) for i in items)
        now = time.monotonic()
        with self._cv:
            self._pending.extend((item, future, now) for item, future in zip(items, futures))
            self._cv.notify()
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def drain(self, timeout: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while (self._pending or self._num_running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True

    async def shutdown(self, timeout: float = 0.0) -> None:
        await self.drain(timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify()
            left, self._pending = list(self._pending), collections.deque()
        from pagoda.engine.async_engine import EngineDeadError

        self.stats.finished_by_reason["abort"] += len(left)
        for _, future, _ in left:
            if future.set_running_or_notify_cancel():  # a cancelled one's caller is gone already
                future.set_exception(EngineDeadError("the server shut down before this input ran"))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def num_running(self) -> int:
        """Inputs in the batch the engine runs now."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Inputs waiting for a batch."""
        return len(self._pending)

    def _next_batch(self) -> list[tuple[PoolingInput, concurrent.futures.Future, float]]:
        """The next batch, empty when every waiting input was cancelled. An input whose caller went away
        (its future cancelled) is dropped here; once taken, a future can no longer be cancelled, so setting
        its result never fails."""
        batch: list = []
        while self._pending and (not batch or self.engine.batch_cost([b[0] for b in batch] + [self._pending[0][0]])
                                 <= self.engine.max_batch_tokens):
            item = self._pending.popleft()
            if item[1].set_running_or_notify_cancel():
                batch.append(item)
            else:
                self.stats.finished_by_reason["abort"] += 1
        now = time.monotonic()
        for _, _, arrival in batch:
            self.stats.request_queue_time.observe(now - arrival)
        return batch

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._pending:
                    return
                batch = self._next_batch()
                self._num_running = len(batch)
            if not batch:
                continue
            try:
                self._run(batch)
            finally:
                self._num_running = 0

    def _run(self, batch: list[tuple[PoolingInput, concurrent.futures.Future, float]]) -> None:
        stats = self.stats
        start = time.monotonic()
        try:
            results = self.engine.run([b[0] for b in batch])
        except Exception as exc:  # noqa: BLE001 - one input may be at fault: find it
            if len(batch) == 1:
                logger.exception("a pooling input failed")
                self._finished(batch, "error")
                batch[0][1].set_exception(exc)
                return
            for one in batch:
                self._run([one])
            return
        finally:
            stats.num_steps += 1
            stats.step_seconds += time.monotonic() - start
        self._finished(batch, "stop")
        for (_, future, _), result in zip(batch, results):
            future.set_result(result)

    def _finished(self, batch: list[tuple[PoolingInput, concurrent.futures.Future, float]], reason: str) -> None:
        now = time.monotonic()
        self.stats.finished_by_reason[reason] += len(batch)
        for _, _, arrival in batch:
            self.stats.e2e_request_latency.observe(now - arrival)
