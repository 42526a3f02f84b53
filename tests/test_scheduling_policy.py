"""The scheduling policy hooks (pagoda.scheduling.SchedulingPolicy): the table of docs/plugins.md is generated from their
docstrings, each documented default is what the base policy does, and a policy's options are checked by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagoda.errors import ConfigError
from pagoda.scheduling import HOOKS, SchedulingPolicy, check_policy_options
from pagoda.scheduling.hook_table import hook_default, hooks_markdown
from pagoda.step import RunnerOutput, SchedulerOutput
from scheduling_sim import SimRunner, make_request, make_scheduler, step

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def test_the_guide_lists_every_hook_as_the_code_documents_it():
    section = re.search(r"<!-- hooks: .*? -->\n(.*?)<!-- end of hooks -->", GUIDE.read_text(), flags=re.S)
    assert section, "docs/plugins.md lost its generated hook table"
    assert section.group(1) == hooks_markdown(), ("docs/plugins.md's hook table differs from the hooks' docstrings: "
                                                  "paste pagoda.scheduling.hook_table.hooks_markdown() between its markers")
    assert set(HOOKS) == {name for name in vars(SchedulingPolicy) if not name.startswith("_")}


def test_fcfs_is_the_defaults():
    from pagoda.plugins.schedulers.fcfs import FCFSPolicy

    assert not set(vars(FCFSPolicy)) & set(HOOKS)


def running_scheduler(num_requests: int = 3, **options):
    """A scheduler with ``num_requests`` requests run one step (prefilled, decoding)."""
    s = make_scheduler(policy_cls=SchedulingPolicy, **options)
    for i in range(num_requests):
        s.add_request(make_request(f"r{i}", [100 + i] * 5, max_tokens=8, arrival=float(i)))
    runner = SimRunner(s.kv.num_blocks, s.kv.block_size)
    step(s, runner)
    return s, runner


def test_the_documented_defaults_are_what_the_base_policy_does():
    s, _ = running_scheduler()
    policy, running = s.policy, list(s.running)
    assert type(policy) is SchedulingPolicy
    assert hook_default("waiting_key").startswith("None") and policy.waiting_key(running[0]) is None
    assert hook_default("running_key").startswith("None") and policy.running_key(running[0]) is None
    assert hook_default("order_waiting") == "the queue as it is." and policy.order_waiting(running) is running
    assert hook_default("order_running") == "the order as given." and policy.order_running(running) is running
    assert "candidates[-1]" in hook_default("choose_victim") and policy.choose_victim(running) is running[-1]
    assert hook_default("may_swap_in") == "True." and policy.may_swap_in(running[0]) is True
    out = SchedulerOutput()
    assert hook_default("preempt_for_arrivals").startswith("does nothing")
    assert policy.preempt_for_arrivals(out) is None and not out.preempted and s.running == running
    for event in ("on_step_start", "on_request_added", "on_request_scheduled", "on_step_executed",
                  "on_request_finished"):
        assert hook_default(event) == "does nothing."
    policy.on_step_start(), policy.on_request_added(running[0]), policy.on_request_scheduled(running[0], 1)
    policy.on_step_executed(out, RunnerOutput.empty(0)), policy.on_request_finished(running[0])
    assert s.running == running and all(not r.is_finished for r in running)


def test_may_admit_says_yes_unless_a_request_is_swapped_out():
    assert hook_default("may_admit") == ("True while no request is swapped out (swapped requests come back first), "
                                         "else False.")
    s, _ = running_scheduler(preemption_mode="swap", num_swap_blocks=16)
    waiting = make_request("new", [7] * 5)
    assert s.policy.may_admit(waiting) is True
    out = SchedulerOutput()
    s.preempt(s.running[-1], out)
    assert s.swapped and s.policy.may_admit(waiting) is False


def test_would_fit_counts_seats_and_free_blocks():
    s, runner = running_scheduler(num_blocks=8, block_size=4, max_num_seqs=4)  # 3 running, 2 blocks each: 2 free
    assert s.would_fit(make_request("small", [9] * 8)) and s.num_blocks_to_start(make_request("small", [9] * 8)) == 2
    assert not s.would_fit(make_request("big", [9] * 9))  # 3 blocks
    s.add_request(make_request("fourth", [8] * 4))
    step(s, runner)
    assert not s.would_fit(make_request("tiny", [9]))  # no seat left


class Stepped(SchedulingPolicy):
    def __init__(self, scheduler, step: int = 1):
        super().__init__(scheduler)
        if step < 1:
            raise ValueError(f"option step is {step}; give an integer >= 1")


def test_an_option_a_policy_does_not_take_is_refused_naming_it_and_the_ones_it_takes():
    check_policy_options("stepped", Stepped, {"step": 2})
    with pytest.raises(ConfigError, match=r"the 'stepped' scheduling policy has no option 'stpe' \(in "
                                          r"--scheduler-options / scheduler_options\); its options are step"):
        check_policy_options("stepped", Stepped, {"stpe": 2})
    with pytest.raises(ConfigError, match="'fcfs' scheduling policy has no option 'step' .*; it takes no options"):
        check_policy_options("fcfs", SchedulingPolicy, {"step": 2})


def test_a_wrong_option_value_is_a_config_error_from_the_policy_through_the_engine_args():
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.kv.blocks import PagedKVCacheManager
    from pagoda.registry.plugin_manager import get_plugin_manager
    from pagoda.scheduling import build_scheduler

    config = EngineArgs.build(scheduling_policy="fair", scheduler_options={"step_seqs": -2},
                              kv_cache_memory_bytes=1 << 20, max_model_len=256).create_engine_config()
    with pytest.raises(ConfigError, match=r"the 'fair' scheduling policy refused its options \{'step_seqs': -2\}: "
                                          r"option step_seqs is -2; give an integer >= 0"):
        build_scheduler(get_plugin_manager(), config.scheduler, config.cache, PagedKVCacheManager(16, 16))


def test_scheduler_options_is_a_json_flag_of_every_engine_command():
    import argparse

    from pagoda.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--scheduling-policy", "fair", "--scheduler-options", '{"step_ms": 100}'])
    assert engine_args_from(ns).scheduler_options == {"step_ms": 100}


def test_no_built_in_or_contrib_policy_uses_a_private_name_of_pagoda():
    """A policy uses its own private helpers (``self._x``) and pagoda's public names only."""
    import ast

    repo = Path(__file__).resolve().parent.parent
    files = [*(repo / "plugins" / "schedulers").glob("*.py"), *(repo / "contrib").glob("pagoda-*/pagoda_*/*.py")]
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(f"{path.relative_to(repo)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagoda"):
                found += [f"{path.relative_to(repo)}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert len(files) >= 6 and not found, found


class WholeScheduler:
    """A scheduler written for the plugin API before policies: a whole scheduler, not a policy."""

    def __init__(self, scheduler_config, cache_config, kv_manager):
        self.kv = kv_manager


class NoHooks:
    def __init__(self, scheduler):
        self.scheduler = scheduler


def test_a_factory_that_is_not_a_policy_is_refused_saying_what_a_policy_is():
    from pagoda.config import CacheConfig, SchedulerConfig
    from pagoda.errors import SchedulingPolicyError
    from pagoda.kv.blocks import PagedKVCacheManager
    from pagoda.scheduling import Scheduler, build_scheduler

    class OnePlugin:
        def get(self, hook, name, option):
            return type("Component", (), {"factory": WholeScheduler})

    sched_cfg = SchedulerConfig("whole", 4, 64, 256, True, 0, None)
    cache_cfg = CacheConfig(4, 0, "auto", False, 16, 0, "recompute", "paged")
    with pytest.raises(ConfigError, match=r"the 'whole' scheduling policy could not be built as factory\(scheduler, "
                                          r"\*\*options\) \(.*\); a pagoda_schedulers component is a scheduling "
                                          r"policy, pagoda.scheduling.SchedulingPolicy"):
        build_scheduler(OnePlugin(), sched_cfg, cache_cfg, PagedKVCacheManager(16, 4, False))
    with pytest.raises(SchedulingPolicyError, match=r"'NoHooks' built a NoHooks, which lacks the scheduling policy "
                                                    r"hooks \['waiting_key', .*subclass it"):
        Scheduler(sched_cfg, cache_cfg, PagedKVCacheManager(16, 4, False), NoHooks)


def scheduler_members_used(tree) -> tuple[set[str], set[str]]:
    """The members a policy's code uses of its scheduler (``self.scheduler.x``, or ``x`` of a local bound to
    ``self.scheduler``) and of the scheduler's KV allocator (``...kv.x``)."""
    import ast

    aliases: set[str] = set()

    def is_scheduler(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "scheduler" and isinstance(node.value, ast.Name)
                and node.value.id == "self") or (isinstance(node, ast.Name) and node.id in aliases)

    aliases |= {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and is_scheduler(node.value)
                for target in node.targets if isinstance(target, ast.Name)}
    on_scheduler, on_kv = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_scheduler(node.value):
            on_scheduler.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "kv" \
                and is_scheduler(node.value.value):
            on_kv.add(node.attr)
    return on_scheduler, on_kv


def test_the_public_scheduler_surface_covers_what_every_built_in_and_contrib_policy_uses():
    """What the built-in policies ask of the scheduler is what docs/plugins.md offers every policy (the queues,
    the limits, the methods of its table, `would_fit` among them), and what they ask of the KV allocator is in its
    Protocol: a third-party policy can do all they do."""
    import ast

    from pagoda import interfaces
    from pagoda.scheduling import Scheduler
    from pagoda.testing import contract_names

    text = GUIDE.read_text()
    paragraph = re.search(r"What a hook may read and do.*?\n\n(.*?)\n\n", text, flags=re.S)
    offered = set(re.findall(r"^\| `(\w+)\(", paragraph.group(1), flags=re.M))
    offered |= set(re.findall(r"`(\w+)`", text[paragraph.start():paragraph.start(1)]))
    assert {"would_fit", "num_blocks_to_start", "preempt", "is_busy", "waiting", "running", "swapped", "kv",
            "max_num_seqs"} <= offered, offered
    assert all(hasattr(Scheduler, name) or name in ("waiting", "running", "swapped", "kv", "max_num_seqs",
                                                    "max_num_batched_tokens") for name in offered), offered
    repo = GUIDE.parent.parent
    files = [*(repo / "plugins" / "schedulers").glob("*.py"), *(repo / "contrib").glob("pagoda-*/pagoda_*/*.py")]
    kv_contract = contract_names(interfaces.KVCacheManager)
    used_anywhere = set()
    for path in files:
        on_scheduler, on_kv = scheduler_members_used(ast.parse(path.read_text()))
        used_anywhere |= on_scheduler
        assert on_scheduler <= offered, f"{path.name} uses the scheduler's {sorted(on_scheduler - offered)}"
        assert on_kv <= kv_contract, f"{path.name} uses the KV allocator's {sorted(on_kv - kv_contract)}"
    assert {"would_fit", "preempt", "is_busy"} <= used_anywhere  # the parse sees the policies' real calls
