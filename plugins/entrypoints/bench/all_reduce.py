"""``pagoda bench all-reduce``: time each all-reduce backend on one tensor shape, ranks on this machine.

Each backend runs in ``--ranks`` fresh processes joined over torch.distributed on 127.0.0.1, built by its
factory from the plugin manager as an engine builds it (the default model's config sizes the ``shm`` slots).
Backends alternate over ``--rounds`` so a busy machine weighs on each alike; each line gives the wall time
per call (the slowest rank's) and the CPU time a rank spends per call (waiting included).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import time

import torch

from pagoda.host.dtypes import resolve_dtype


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="time each all-reduce backend (gloo, shm, plugins) over ranks on this machine")
    p.add_argument("--backends", default="gloo,shm", help="comma-separated all-reduce backend names")
    p.add_argument("--ranks", type=int, default=2, help="processes taking part")
    p.add_argument("--shape", type=int, nargs="+", default=[64, 576],
                   help="the tensor summed (default: a decode step's activations at batch 64, default model)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=2, help="times each backend runs, alternating")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from pagoda.errors import ConfigError
    from pagoda.registry.plugin_manager import get_plugin_manager

    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    pm = get_plugin_manager()
    for name in backends:  # a typo fails before any process starts
        pm.get("pagoda_all_reduce_backends", name, "--backends")
    if ns.ranks < 2:
        raise ConfigError(f"--ranks {ns.ranks}: an all-reduce needs at least 2 ranks")
    dtype = resolve_dtype(ns.dtype)
    print(f"all-reduce of {list(ns.shape)} {ns.dtype} over {ns.ranks} ranks, {ns.iters} calls per round")
    context = multiprocessing.get_context("spawn")
    for round_ in range(1, ns.rounds + 1):
        for name in backends:
            queue = context.Queue()
            address = f"tcp://127.0.0.1:{_free_port()}"
            procs = [context.Process(target=_rank_main, args=(rank, ns.ranks, name, address, ns.shape, dtype,
                                                              ns.iters, queue)) for rank in range(ns.ranks)]
            for p in procs:
                p.start()
            results = [queue.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
            errors = [r for r in results if isinstance(r, str)]
            if errors:
                print(f"round {round_} {name:<6} failed: {errors[0]}")
                continue
            wall = max(r[0] for r in results)
            cpu = sorted(r[1] for r in results)
            print(f"round {round_} {name:<6} {wall * 1e6:8.0f} us per call   CPU per rank "
                  + " / ".join(f"{c * 1e6:.0f}" for c in cpu) + " us")
    return 0


def _rank_main(rank: int, size: int, name: str, address: str, shape: list[int], dtype: torch.dtype,
               iters: int, queue) -> None:
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.registry.plugin_manager import get_plugin_manager

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    try:
        config = EngineArgs(tensor_parallel_size=size, all_reduce_backend=name).create_engine_config()
        factory = get_plugin_manager().get("pagoda_all_reduce_backends", name, "--backends").factory
        comm = factory(config, rank, size, torch.distributed.group.WORLD, 60.0)
        x = torch.randn(shape).to(dtype)
        for _ in range(50):  # warm-up
            comm.all_reduce(x)
            x.mul_(0.5)
        torch.distributed.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            comm.all_reduce(x)
            x.mul_(0.5)  # keeps the values finite; the same on every rank
        queue.put(((time.perf_counter() - start) / iters, (time.process_time() - cpu) / iters))
        comm.close()
    except Exception as exc:
        queue.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
