"""Executors: the processes a model runs in. The driver alone schedules; an executor runs each step on
every rank and returns rank 0's result.

- ``uni``: one process, the model whole (``tensor_parallel_size`` 1).
- ``ray``: the same ranks as Ray actors (see :class:`RayExecutor`).
- ``mp``: ``tensor_parallel_size x pipeline_parallel_size`` processes on this machine. The driver is rank 0
  and runs its shard in-process; ranks 1.. are spawned workers, each building its shard of the same model.
  Every step the driver sends the workers what they need to run it too (the step's layout and, for each
  sequence, the tokens they have not seen yet), then all ranks run it in lockstep: the collectives inside the
  model (one all-reduce per row-parallel projection, the vocab all-gather) join a stage's ranks, and each
  stage hands its hidden states to the next (:mod:`pagoda.execution.pipeline`). Every rank of the last stage
  samples the same tokens from the same logits and seeds; with one stage the driver's result is the step's,
  with more the last stage's first rank sends its result back to the driver, and the others are dropped.

With pipeline stages, ``mp`` and ``ray`` also split a step in two: ``submit`` sends it and runs the driver's
stage, ``collect`` receives the last stage's result, so the engine can submit the next step while the later
stages run this one (``LLMEngine.step`` with steps in flight). Every rank takes the steps (and block moves) in the order
sent, so steps pass the stages in order and are collected in that order.

Workers build their components from their own plugin manager, loaded from the installed entry points
(a plugin registered by hand in the driver process does not reach them).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import socket
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from pagoda import hookimpl
from pagoda.config import EngineConfig
from pagoda.errors import ConfigError, PagodaError
from pagoda.execution import pipeline
from pagoda.host.processes import ForkedProcess
from pagoda.sequence import Sequence
from pagoda.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.execution.lora import LoRAStep

logger = logging.getLogger("pagoda")

# seconds a rank waits in a collective for the others before giving up (a worker that died)
COLLECTIVE_TIMEOUT_SECONDS = 300.0


class WorkerLostError(PagodaError):
    """A rank of a tensor-parallel model is gone; no step can run until the engine is restarted."""


class UniExecutor:
    """The model whole, in this process: its ``execute`` and ``move_blocks`` are its runner's own, so a
    step goes from the engine straight to the runner."""

    def __init__(self, config: EngineConfig, plugin_manager: Any) -> None:
        from pagoda.execution.build import build_runner

        if config.parallel.world_size != 1:
            raise ConfigError(f"the uni executor runs one process; tensor_parallel_size="
                              f"{config.parallel.tensor_parallel_size} x pipeline_parallel_size="
                              f"{config.parallel.pipeline_parallel_size} needs distributed_executor_backend='mp'")
        self.runner = build_runner(config, plugin_manager)
        self.execute: Callable[[SchedulerOutput], RunnerOutput] = self.runner.execute
        self.move_blocks: Callable[[SchedulerOutput], list[int]] = self.runner.move_blocks
        self.submit = self.collect = None  # one process: no later stage to keep a step in flight in

    def shutdown(self) -> None:
        pass


class StepMessage:
    """A step as the workers need it: the layout, per sequence what they do not know yet, and with LoRA on,
    rank 0's adapter decisions (the slot of each sequence, the adapters copied into slots since the last step)."""

    def __init__(self, sched: SchedulerOutput, sequences: list[tuple], finished: list[str] = (),
                 lora: Optional[LoRAStep] = None) -> None:
        self.sequences = sequences  # (request id, new tokens, (prompt length, params, eos, seed) or None)
        self.finished = list(finished)  # request ids the workers may forget
        self.layout = dataclasses.replace(sched, requests=[], preempted=[])
        self.lora = lora


class PendingStep:
    """A step submitted to the pipeline stages (``MultiprocExecutor.submit``, ``RayExecutor.submit``): its parts,
    how many reached the later stages, the error the driver's stage raised, and the parts' results once
    received (from the last stage's first rank)."""

    def __init__(self, sched: SchedulerOutput, parts: list[list[int]], num_sent: int,
                 error: Optional[Exception]) -> None:
        self.sched = sched
        self.parts = parts
        self.num_sent = num_sent
        self.error = error
        self.results: Optional[list] = None
        self.refs: list = []  # Ray: each part's object refs, one per actor

    def output(self) -> RunnerOutput:
        """The step's result, its parts merged; raises the driver's error instead if its stage raised."""
        if self.error is not None:
            raise self.error
        if len(self.parts) == 1:
            return self.results[0]
        return RunnerOutput.merge(len(self.sched.requests), list(zip(self.parts, self.results)))


class _Driver:
    """Rank 0 in the driver process: sends each step to the other ranks, then runs it itself."""

    runner: Any

    def __init__(self, config: EngineConfig) -> None:
        # request id -> (the sequence, how many of its tokens the other ranks hold)
        self.sent: dict[str, tuple[Sequence, int]] = {}
        self.output_rank = output_rank(config)
        self.num_micro_batches = config.parallel.pipeline_micro_batches if self.output_rank else 1

    def _micro_batches(self, sched: SchedulerOutput) -> list[list[int]]:
        """The step's requests in up to ``num_micro_batches`` contiguous parts of about equal token counts."""
        n = len(sched.requests)
        parts = min(self.num_micro_batches, n)
        if parts <= 1:
            return [list(range(n))]
        total, bounds, done = sched.num_batched_tokens, [], 0
        for i, count in enumerate(sched.num_new_tokens):
            done += count
            if len(bounds) < parts - 1 and done * parts >= total * (len(bounds) + 1) and i < n - 1:
                bounds.append(i + 1)
        edges = [0, *bounds, n]
        return [list(range(a, b)) for a, b in zip(edges, edges[1:]) if b > a]

    def _message(self, sched: SchedulerOutput) -> StepMessage:
        # first: an adapter that cannot be read again fails the step before the ranks are told anything
        lora_manager = self.runner.lora
        lora = None if lora_manager is None else lora_manager.plan([seq.lora_request for seq in sched.requests])
        finished = [rid for rid, (seq, _) in self.sent.items() if seq.status.is_finished]
        for rid in finished:
            del self.sent[rid]
        sequences = []
        for seq in sched.requests:
            known = self.sent.get(seq.request_id)
            if known is None:
                header = (seq.num_prompt_tokens, seq.sampling_params, seq.eos_token_id, seq.more_eos_token_ids,
                          seq.seed)
                sequences.append((seq.request_id, list(seq.all_token_ids), header))
            else:
                sequences.append((seq.request_id, seq.all_token_ids[known[1]:], None))
            self.sent[seq.request_id] = (seq, seq.num_tokens)
        return StepMessage(sched, sequences, finished, lora)


class MultiprocExecutor(_Driver):
    """``tensor_parallel_size x pipeline_parallel_size`` ranks on this machine: rank 0 here, the others in
    spawned processes."""

    def __init__(self, config: EngineConfig, plugin_manager: Any) -> None:
        from pagoda.execution.build import build_runner
        from pagoda.execution import distributed

        super().__init__(config)
        # submitted steps whose results are not received yet, oldest first
        self._pending: collections.deque[PendingStep] = collections.deque()
        size = config.parallel.world_size
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = _rank_start_context()
        environment = dict(os.environ)
        self.pipes, self.workers = [], []
        # forked by the fork server without running the program's script again (pagoda.host.processes)
        process_class = ForkedProcess if context.get_start_method() == "forkserver" else context.Process
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            worker = process_class(target=_worker_main, args=(config, rank, size, address, theirs, environment),
                                   daemon=True, name=f"pagoda-rank{rank}")
            worker.start()
            self.pipes.append(ours)
            self.workers.append(worker)
        try:
            _wait_started(self.pipes, self.workers, COLLECTIVE_TIMEOUT_SECONDS)
            distributed.init(0, size, address, COLLECTIVE_TIMEOUT_SECONDS, config, plugin_manager)
            self.runner = build_runner(config, plugin_manager)
            for rank, (pipe, worker) in enumerate(zip(self.pipes, self.workers), start=1):
                # each worker says it built its shard, or why it could not
                try:
                    status = pipe.recv()
                except (EOFError, OSError):
                    raise _rank_exited(rank, worker, "while building its shard (a signal -9 is usually the kernel's "
                                                     "out-of-memory killer)") from None
                if status != "ready":
                    raise PagodaError(f"a tensor-parallel worker failed to start:\n{status}")
        except BaseException:
            _stop(self.pipes, self.workers)
            raise
        # an engine dropped without shutdown() still stops its workers and leaves its process group
        self._finalizer = weakref.finalize(self, _stop, self.pipes, self.workers)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.output_rank == 0:
            self._send("execute", self._message(sched))
            return self.runner.execute(sched)
        return self.collect(self.submit(sched))

    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Start the step: the workers are sent it and the driver runs its stage (the first); the later stages
        run it while this returns. Its result comes from :meth:`collect`, steps being collected in the order
        they were submitted."""
        # pipeline stages: each part goes through the first stage here and on to the next while the first
        # runs the part after it; the last stage returns the parts' results in order
        parts, num_sent, error = self._micro_batches(sched), 0, None
        try:
            for indices in parts:
                part = sched if len(parts) == 1 else sched.select(indices)
                self._send("execute", self._message(part))
                num_sent += 1
                pipeline.timed_execute(self.runner, part)
        except WorkerLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the later stages ran the parts sent; their results are dropped
            error = exc
        step = PendingStep(sched, parts, num_sent, error)
        self._pending.append(step)
        return step

    def collect(self, step: PendingStep) -> RunnerOutput:
        """The result of a submitted step (raises what its execution raised on the driver's stage). Steps
        submitted before it are received first and kept for their own collect."""
        while step.results is None:
            oldest = self._pending.popleft()
            oldest.results = [self._receive_output() for _ in range(oldest.num_sent)]
        return step.output()

    def stage_stats(self) -> list[dict[str, tuple[int, float]]]:
        """Every rank's stage work so far, by rank (see :func:`pagoda.execution.pipeline.stats_snapshot`)."""
        if self._pending:
            self.collect(self._pending[-1])  # the steps in flight answer first: their results are kept
        self._send("stats", StepMessage(SchedulerOutput(), []))
        return [pipeline.stats_snapshot()] + [pipe.recv() for pipe in self.pipes]

    def _receive_output(self) -> RunnerOutput:
        """The step's result, from the last pipeline stage's first rank."""
        pipe, worker = self.pipes[self.output_rank - 1], self.workers[self.output_rank - 1]
        try:
            return pipe.recv()
        except (EOFError, OSError):
            worker.join(timeout=1)
            raise WorkerLostError(f"rank {self.output_rank} (process {worker.pid}, the last pipeline stage) exited "
                                  f"with code {worker.exitcode}; the model cannot run without it: restart the engine "
                                  "(a signal -9 is usually the kernel's out-of-memory killer)") from None

    def move_blocks(self, sched: SchedulerOutput) -> list[int]:
        self._send("move_blocks", StepMessage(sched, []))
        return self.runner.move_blocks(sched)

    def shutdown(self) -> None:
        self._finalizer()

    def _send(self, kind: str, message: StepMessage) -> None:
        for rank, (pipe, worker) in enumerate(zip(self.pipes, self.workers), start=1):
            try:
                if not worker.is_alive():
                    raise BrokenPipeError
                pipe.send((kind, message))
            except (BrokenPipeError, OSError):
                worker.join(timeout=1)
                raise WorkerLostError(f"tensor-parallel rank {rank} (process {worker.pid}) exited with code "
                                      f"{worker.exitcode}; the model cannot run without it: restart the engine "
                                      "(a signal -9 is usually the kernel's out-of-memory killer)") from None


class RayExecutor(_Driver):
    """Ranks 1.. as Ray actors in a placement group (one bundle per rank), rank 0 in the driver process.

    Joins the Ray cluster at ``RAY_ADDRESS`` if set, else the one this process already started with
    ``ray.init``, else starts a local one. The ranks meet over torch.distributed at the driver's address
    as Ray reports it, so the actors may run on other machines of the cluster."""

    def __init__(self, config: EngineConfig, plugin_manager: Any) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'pagoda[ray]'") from None
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagoda.execution.build import build_runner
        from pagoda.execution import distributed

        super().__init__(config)
        size = config.parallel.world_size
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        threads = _threads_per_rank(config, size)
        self.group = placement_group([{"CPU": threads}] * max(1, size - 1), strategy="PACK")
        self.actors: list = []
        try:
            ray.get(self.group.ready(), timeout=120)
            address = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            actor = ray.remote(num_cpus=threads)(RayWorker)
            self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i))
                           .remote(config, rank, size, address) for i, rank in enumerate(range(1, size))]
            distributed.init(0, size, address, COLLECTIVE_TIMEOUT_SECONDS, config, plugin_manager)
            self.runner = build_runner(config, plugin_manager)
            ray.get([a.ready.remote() for a in self.actors])  # a rank that failed to build raises here
        except BaseException:
            self._release(ray, remove_placement_group)
            raise
        self._ray, self._remove_group = ray, remove_placement_group

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.output_rank == 0:
            pending = [a.execute.remote(self._message(sched)) for a in self.actors]
            result = self.runner.execute(sched)
            self._ray.get(pending)  # a rank's failure surfaces with this step
            return result
        return self.collect(self.submit(sched))

    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Start the step (see :meth:`MultiprocExecutor.submit`): the actors are sent it, the driver runs the
        first stage; an actor runs its calls in the order sent, so steps pass the stages in order."""
        parts, refs, error = self._micro_batches(sched), [], None
        try:
            for indices in parts:  # the parts one behind the other through the stages (see MultiprocExecutor)
                part = sched if len(parts) == 1 else sched.select(indices)
                message = self._message(part)  # once: it records what the ranks now hold
                refs.append([a.execute.remote(message) for a in self.actors])
                pipeline.timed_execute(self.runner, part)
        except Exception as exc:  # noqa: BLE001 - the later stages ran the parts sent; their results are dropped
            error = exc
        step = PendingStep(sched, parts, len(refs), error)
        step.refs = refs
        return step

    def collect(self, step: PendingStep) -> RunnerOutput:
        """The result of a submitted step (raises what its execution raised on any rank)."""
        if step.results is None:  # every rank's reply is awaited: a rank's failure surfaces with its step
            step.results = [self._ray.get(part)[self.output_rank - 1] for part in step.refs]
        return step.output()

    def stage_stats(self) -> list[dict[str, tuple[int, float]]]:
        """Every rank's stage work so far, by rank (see :func:`pagoda.execution.pipeline.stats_snapshot`)."""
        return [pipeline.stats_snapshot()] + self._ray.get([a.stats.remote() for a in self.actors])

    def move_blocks(self, sched: SchedulerOutput) -> list[int]:
        pending = [a.move_blocks.remote(StepMessage(sched, [])) for a in self.actors]
        failed = self.runner.move_blocks(sched)
        self._ray.get(pending)
        return failed

    def shutdown(self) -> None:
        if getattr(self, "_ray", None) is not None:
            self._release(self._ray, self._remove_group)
            self._ray = None

    def _release(self, ray: Any, remove_placement_group: Any) -> None:
        from pagoda.execution import distributed

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement_group(self.group)
        distributed.shutdown()


class RayWorker:
    """A worker rank as a Ray actor."""

    def __init__(self, config: EngineConfig, rank: int, size: int, address: str) -> None:
        self.rank = WorkerRank(config, rank, size, address)

    def ready(self) -> bool:
        return True

    def execute(self, message: StepMessage) -> RunnerOutput:
        return self.rank.execute(message)

    def stats(self) -> dict[str, tuple[int, float]]:
        return self.rank.stats(None)

    def move_blocks(self, message: StepMessage) -> None:
        self.rank.move_blocks(message)


def _stop(pipes: list, workers: list) -> None:
    """Tell the workers to stop, wait for them (killing one that hangs), and leave the process group."""
    from pagoda.execution import distributed

    for pipe in pipes:
        try:
            pipe.send(("shutdown", None))
        except (OSError, BrokenPipeError):
            pass
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    pipes.clear()
    workers.clear()
    distributed.shutdown()


class WorkerRank:
    """One worker rank: its shard of the model, and a mirror of the sequences the driver has sent it."""

    def __init__(self, config: EngineConfig, rank: int, size: int, address: str) -> None:
        import torch

        from pagoda.execution.build import build_runner
        from pagoda.execution import distributed
        from pagoda.registry.plugin_manager import PluginManager

        torch.set_num_threads(_threads_per_rank(config, size))
        plugin_manager = PluginManager().load()
        distributed.init(rank, size, address, COLLECTIVE_TIMEOUT_SECONDS, config, plugin_manager)
        self.runner = build_runner(config, plugin_manager)
        self.mirror: dict[str, Sequence] = {}

    def execute(self, message: StepMessage) -> RunnerOutput:
        for rid in message.finished:
            self.mirror.pop(rid, None)
        sched = message.layout
        for rid, tokens, header in message.sequences:
            if header is not None:
                num_prompt, params, eos, more_eos, seed = header
                seq = self.mirror[rid] = Sequence(rid, tokens[:num_prompt], params, eos, seed=seed,
                                                  more_eos_token_ids=more_eos)
                seq.all_token_ids = list(tokens[:num_prompt])
                tokens = tokens[num_prompt:]
            seq = self.mirror[rid]
            seq.all_token_ids.extend(tokens)
            seq.output_token_ids.extend(tokens)
            sched.requests.append(seq)
        if message.lora is not None:
            self.runner.lora.receive(message.lora)
        return pipeline.timed_execute(self.runner, sched)

    def stats(self, message: Any) -> dict[str, tuple[int, float]]:
        return pipeline.stats_snapshot()

    def move_blocks(self, message: StepMessage) -> None:
        self.runner.move_blocks(message.layout)


def _wait_started(pipes: list[Any], workers: list[Any], timeout: float) -> None:
    """Until every rank process has started (its first message), so that one which exits while starting is
    reported at once with its exit code instead of the driver waiting for it at the rendezvous."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    for rank, (pipe, worker) in enumerate(zip(pipes, workers), start=1):
        if not wait([pipe, worker.sentinel], max(0.0, deadline - time.monotonic())):
            raise PagodaError(f"tensor-parallel rank {rank} (process {worker.pid}) did not start within {timeout:g} s")
        try:
            if pipe.poll():
                pipe.recv()
                continue
        except (EOFError, OSError):
            pass
        raise _rank_exited(rank, worker, "while starting, before it built its shard; its error is on stderr")


def _rank_exited(rank: int, worker: Any, when: str) -> PagodaError:
    """The error of a rank process that exited ``when`` (its exit code read once it has ended)."""
    worker.join(timeout=5)
    return PagodaError(f"tensor-parallel rank {rank} (process {worker.pid}) exited with code {worker.exitcode} {when}")


def _rank_start_context() -> Any:
    """How ``mp`` ranks start: forked by multiprocessing's fork server where there is one (Linux, macOS), else
    spawned. The fork server is one clean process per driver process, started with the first rank; it imports
    torch and pagoda's built-in components once, and each rank forked from it starts with them imported (about
    3 s of CPU less per rank after the first, and their pages shared until written). Every rank is still a
    fresh fork of a process with no threads, as a spawned one would be. (A fork server already started in this
    process, e.g. by structured outputs' compile processes, is used as it is: its ranks import what it lacks.)"""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    import importlib.metadata

    from pagoda.registry.plugin_manager import ENTRY_POINT_GROUP, PAGODA_DIST

    # what a rank imports first: torch, the runner's modules, and pagoda's own plugins (the modules its
    # PluginManager().load() imports; other distributions' plugins are imported in each rank, as before)
    own_plugins = sorted({ep.value.partition(":")[0] for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                          if ep.dist is not None and ep.dist.name == PAGODA_DIST})
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "pagoda.execution.build", *own_plugins])
    return context


def _worker_main(config: EngineConfig, rank: int, size: int, address: str, pipe: Any,
                 environment: Optional[dict[str, str]] = None) -> None:
    """An mp worker process: build the rank, then run every step the driver sends until told to stop.
    ``environment``: the driver's environment variables when it started the rank (a rank forked by the fork
    server would otherwise see the fork server's, those of the moment the first rank started)."""
    from pagoda.execution import distributed

    pipe.send("started")
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    try:
        worker = WorkerRank(config, rank, size, address)
    except BaseException:
        pipe.send(traceback.format_exc())
        return
    pipe.send("ready")
    sends_output = rank == output_rank(config)
    while True:
        try:
            kind, message = pipe.recv()
        except EOFError:  # the driver is gone
            break
        if kind == "shutdown":
            break
        result = getattr(worker, kind)(message)
        if kind == "stats" or (kind == "execute" and sends_output):
            pipe.send(result)
    if worker.runner.kv_tiers is not None:
        worker.runner.kv_tiers.flush()  # block files still being written
    distributed.shutdown()


def output_rank(config: EngineConfig) -> int:
    """The rank whose step result is the engine's: rank 0, or the last pipeline stage's first rank."""
    return (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size


def _threads_per_rank(config: EngineConfig, size: int) -> int:
    """``cpu_threads`` per rank when given, else this machine's cores shared out."""
    return config.parallel.cpu_threads or max(1, (os.cpu_count() or 1) // size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def select_executor(config: EngineConfig) -> str:
    """``auto``: ``uni`` for one rank, ``mp`` for more."""
    name = config.parallel.distributed_executor_backend
    if name == "auto":
        return "uni" if config.parallel.world_size == 1 else "mp"
    return name


@hookimpl
def pagoda_executors():
    return {"uni": UniExecutor, "mp": MultiprocExecutor, "ray": RayExecutor}
