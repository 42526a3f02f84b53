"""The all-reduce backends: ``shm`` sums and gathers like torch across 2 real processes, in chunks when a tensor
is larger than its slot; a rank that exits or never arrives fails the others with its name; nothing is left in
/dev/shm; ``auto`` falls back to gloo when a rank cannot map the file; TP=2 over ``shm`` gives the tokens of gloo.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch

from pagoda import LLM
from pagoda.errors import ConfigError
from pagoda.execution import distributed
from pagoda.execution.shm_all_reduce import NAME_PREFIX, shm_directory
from pagoda.modeling.default_model import ensure_default_model

from test_tensor_parallel import PARAMS, PROMPTS, assert_same_tokens, run
from tiny_models import write_tiny_llama

# (shape, dtype): sizes that are not multiples of anything, one larger than the 1 KiB slot (several rounds)
CASES = [((1,), torch.float32), ((7,), torch.float32), ((3, 37), torch.float32), ((1000,), torch.float32),
         ((5, 11), torch.bfloat16), ((999,), torch.bfloat16)]
SLOT_BYTES = 1024


def _part(rank: int, index: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of case ``index``: any process can make any rank's."""
    gen = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what one pair of ranks runs, in this order ("absent" ends with rank 1 exiting)
SCENARIOS = ("sums", "fallback", "absent")


def _rank_main(rank: int, address: str, out: Path) -> None:
    """One of 2 ranks: joins over gloo, then runs each of SCENARIOS, saving what it saw after each (into
    ``out/rank{rank}.pt``, by scenario)."""
    torch.set_num_threads(1)
    # a rank left waiting in a collective by the other's failure gives up (and reports it) within a minute
    torch.distributed.init_process_group("gloo", init_method=address, rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    group = torch.distributed.group.WORLD
    results: dict = {}
    try:
        for scenario in SCENARIOS:
            result = results[scenario] = {}
            if scenario == "absent":  # rank 1 leaves in it: what it saw so far is saved first
                torch.save(results, out / f"rank{rank}.pt")
            try:
                _scenario(scenario, rank, group, result)
                if scenario != "absent":
                    torch.distributed.barrier(group=group)  # both ranks done before the next scenario
            except BaseException:
                result["crash"] = traceback.format_exc()
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        torch.distributed.destroy_process_group()


def _scenario(scenario: str, rank: int, group: object, result: dict) -> None:
    from pagoda.execution import shm_all_reduce
    from pagoda.execution.shm_all_reduce import ShmAllReduce

    if scenario == "fallback":
        from pagoda.engine.engine_args import EngineArgs
        from pagoda.execution.collectives import build_all_reduce
        from pagoda.registry.plugin_manager import PluginManager

        mapper = shm_all_reduce._map
        if rank == 1:  # as if rank 1 were on another host: rank 0's file is not there
            def cannot_map(path, total, fd):
                raise FileNotFoundError(2, "No such file or directory", path)
            shm_all_reduce._map = cannot_map
        try:
            pm = PluginManager().load()
            config = EngineArgs(model=str(ensure_default_model()), tensor_parallel_size=2).create_engine_config()
            result["auto"] = build_all_reduce(config, pm, rank, 2, group, 5.0)[0]
            try:
                shm_only = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                                    all_reduce_backend="shm"))
                build_all_reduce(shm_only, pm, rank, 2, group, 5.0)
            except ConfigError as exc:
                result["shm"] = str(exc)
        finally:
            shm_all_reduce._map = mapper
        return
    comm = ShmAllReduce(rank, 2, group, timeout_seconds=1.0, slot_bytes=SLOT_BYTES)
    result["listed"] = sorted(p.name for p in Path(shm_directory()).glob(NAME_PREFIX + "*"))
    result["path"] = comm.path
    if scenario == "sums":
        from pagoda.execution.collectives import TorchAllReduce
        from pagoda.interfaces import AllReduce

        result["protocol"] = [isinstance(c, AllReduce) for c in (comm, TorchAllReduce(None, rank, 2, group, 1.0))]
        result["sums"] = []
        for i, (shape, dtype) in enumerate(CASES):
            x = _part(rank, i, shape, dtype)
            comm.all_reduce(x)
            gathered = comm.all_gather(_part(rank, i, shape, dtype))
            result["sums"].append((x, gathered))
        strided = _part(rank, 99, (6, 9), torch.float32).t()  # not contiguous: summed in place all the same
        comm.all_reduce(strided)
        result["strided"] = strided
    elif scenario == "absent":
        if rank == 1:  # alive but never joins an all-reduce, then exits
            torch.distributed.barrier(group=group)
            os._exit(3)
        for when in ("late", "again"):
            try:
                comm.all_reduce(torch.ones(4))
            except Exception as exc:
                result[when] = f"{type(exc).__name__}: {exc}"
        torch.distributed.barrier(group=group)
        comm.failure = None  # to see the next wait find rank 1 gone
        try:
            comm.all_reduce(torch.ones(4))
        except Exception as exc:
            result["exited"] = f"{type(exc).__name__}: {exc}"
    comm.close()
    maps = Path("/proc/self/maps").read_text()
    result["mapped_after_close"] = NAME_PREFIX in maps


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, list[dict]]:
    """Scenario -> what each of 2 real rank processes saw in it (one pair of processes runs them all)."""
    out = tmp_path_factory.mktemp("ranks")
    context = multiprocessing.get_context("spawn")
    address = f"tcp://127.0.0.1:{_free_port()}"
    procs = [context.Process(target=_rank_main, args=(r, address, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode is not None, "a rank hung"
    results = [torch.load(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else {} for r in range(2)]
    return {scenario: [r.get(scenario, {}) for r in results] for scenario in SCENARIOS}


def results_of(scenarios: dict, scenario: str) -> list[dict]:
    """Both ranks' results of one scenario; fails with a rank's traceback if it crashed."""
    results = scenarios[scenario]
    for result in results:
        assert "crash" not in result, result["crash"]
    return results


@pytest.fixture
def summed(scenarios):
    return results_of(scenarios, "sums")


def test_shm_sums_and_gathers_like_torch_in_rank_order_on_both_ranks(summed):
    """Both backends meet the AllReduce protocol; shm's sums equal torch's add of the parts in rank order."""
    results = summed
    assert all(r["protocol"] == [True, True] for r in results)
    for i, (shape, dtype) in enumerate(CASES):
        parts = [_part(r, i, shape, dtype) for r in range(2)]
        expected = parts[0] + parts[1]  # rank order; bf16 rounds the sum once, as torch's bf16 add does
        for result in results:
            total, gathered = result["sums"][i]
            assert total.dtype == dtype and total.shape == shape
            assert torch.equal(total, expected), (shape, dtype)
            assert all(torch.equal(g, p) for g, p in zip(gathered, parts))
        assert torch.equal(results[0]["sums"][i][0], results[1]["sums"][i][0])
    strided = _part(0, 99, (6, 9), torch.float32).t() + _part(1, 99, (6, 9), torch.float32).t()
    assert all(torch.equal(result["strided"], strided) for result in results)


def test_shm_leaves_nothing_in_dev_shm_and_unmaps_on_close(summed):
    results = summed
    path = results[0]["path"]
    assert path and Path(path).name.startswith(NAME_PREFIX)
    assert all(Path(path).name not in r["listed"] for r in results), "the file is unlinked once both ranks mapped it"
    assert not Path(path).exists()
    assert not any(r["mapped_after_close"] for r in results)


def test_a_rank_that_never_arrives_times_out_and_one_that_exits_fails_at_once_each_named(scenarios):
    results = results_of(scenarios, "absent")
    late, exited = results[0]["late"], results[0]["exited"]
    assert late.startswith("CollectiveError") and "rank 1 (process" in late and "did not arrive" in late
    assert results[0]["again"] == late, "after a failed collective the ranks' rounds differ: every call fails"
    assert exited.startswith("CollectiveError") and "rank 1 (process" in exited and "exited" in exited
    assert not Path(results[0]["path"]).exists()


def test_auto_falls_back_to_gloo_on_every_rank_when_a_rank_cannot_map_the_file(scenarios):
    results = results_of(scenarios, "fallback")
    assert [r["auto"] for r in results] == ["gloo", "gloo"]
    assert all("all_reduce_backend 'shm' cannot run here" in r["shm"] for r in results)
    assert "rank 1" in results[0]["shm"] and "--all-reduce-backend gloo" in results[0]["shm"]


def test_an_unknown_backend_is_refused_listing_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown all-reduce backend 'mpi' for all_reduce_backend; "
                                          r"available: 'gloo' .*'shm'"):
        LLM(dtype="float32", max_model_len=256, tensor_parallel_size=2, all_reduce_backend="mpi")


def _own_shm_files() -> list[str]:
    return [p.name for p in Path(shm_directory()).glob(f"{NAME_PREFIX}{os.getpid()}-*")]


def test_two_ranks_over_shm_give_the_tokens_of_gloo_and_leave_nothing_mapped(tmp_path):
    """(tests/test_tensor_parallel.py compares TP=2 with TP=1 under ``auto``, which is ``shm`` on a CPU host, on
    the default model.) A tiny random model whose heads, MLP and vocabulary split unevenly: every all-reduce of
    the row-parallel layers and the LM head's gather go through each backend."""
    model = str(write_tiny_llama(tmp_path, hidden=96, heads=3, kv_heads=1, head_dim=32, inter=99, vocab=49153))
    llm = LLM(model=model, dtype="float32", max_model_len=512, cpu_threads=1, tensor_parallel_size=2,
              kv_cache_memory_bytes=64 << 20)
    try:
        assert distributed.current().comm_name == "shm"  # auto, on this CPU host
        assert not _own_shm_files(), "the file is unlinked once every rank mapped it"
        shm = llm.generate(PROMPTS, PARAMS * 2, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert NAME_PREFIX not in Path("/proc/self/maps").read_text(), "shut down, the driver unmaps the file"
    gloo = run(2, model, num_requests=len(PROMPTS), all_reduce_backend="gloo")
    worst = assert_same_tokens(gloo, shm)
    print(f"tiny model, TP=2 over shm vs over gloo: largest logprob difference {worst:.2e}")
    assert worst < 1e-3


def test_bench_all_reduce_refuses_an_unknown_backend_before_starting_ranks(capsys):
    from pagoda.cli import main

    assert main(["bench", "all-reduce", "--backends", "gloo,mpi"]) == 2
    assert "unknown all-reduce backend 'mpi' for --backends; available: 'gloo'" in capsys.readouterr().err
