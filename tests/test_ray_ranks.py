"""Ranks as Ray actors (``distributed_executor_backend="ray"``) give the tokens of ranks in one process: pipeline
stages of a tiny model, two tensor-parallel ranks of the default model, and two ranks serving LoRA adapters.

The ``mp`` executor's tests (test_pipeline_parallel.py, test_tensor_parallel.py, test_lora_tensor_parallel.py)
check the same mechanisms in depth; here the Ray executor runs each once, in one local Ray cluster (its start
costs as much as the three runs together). Each placement group is removed when its engine shuts down.
"""

from __future__ import annotations

import pytest

from pagoda.modeling.default_model import ensure_default_model

import test_lora_tensor_parallel as lora_tp
import test_pipeline_parallel as pp
import test_tensor_parallel as tp
from test_pipeline_parallel import one_stage, three_layers  # noqa: F401 - the module fixtures, shared


def all_removed(ray) -> bool:
    table = ray.util.placement_group_table()
    return bool(table) and all(group["state"] == "REMOVED" for group in table.values())


def test_ray_actors_as_stages_give_the_tokens_of_one(ray_cluster, three_layers, one_stage):
    worst = pp.assert_same_tokens(one_stage, pp.run(three_layers, pp=2, prompts=pp.TOKEN_PROMPTS,
                                                    distributed_executor_backend="ray", pipeline_micro_batches=2,
                                                    in_flight=2))
    assert worst < 1e-4
    assert all_removed(ray_cluster)


def test_ray_actors_as_ranks_give_the_default_model_s_tokens(ray_cluster):
    model = str(ensure_default_model())
    # a Ray step costs a remote call per rank: a short run (the mp tests cover preemption and more requests)
    one_rank = tp.run(1, model, num_requests=3)
    worst = tp.assert_same_tokens(one_rank, tp.run(2, model, num_requests=3, distributed_executor_backend="ray"))
    print(f"default model, TP=2 on Ray actors vs TP=1: largest logprob difference {worst:.2e}")
    assert worst < 1e-3
    assert all_removed(ray_cluster)


def test_ray_actors_as_ranks_give_one_ranks_tokens_with_adapters(ray_cluster, tmp_path_factory):
    model_dir, loras = lora_tp.model_with_adapters(tmp_path_factory, "tiny")
    two = loras[:2]  # a Ray step costs a remote call per rank: two adapters, both in slots throughout
    lora_tp.assert_same_tokens(lora_tp.generate(model_dir, two, 1),
                               lora_tp.generate(model_dir, two, 2, distributed_executor_backend="ray"), len(two))
    assert all_removed(ray_cluster)
