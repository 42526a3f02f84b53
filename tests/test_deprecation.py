"""Deprecated names of the plugin API keep working, with a DeprecationWarning naming the old name, the new
one and the version that removes it, until that version; a shim that outlives it fails this suite.

No hook and no component method has been renamed yet, so those two mechanisms are shown on renames the
tests add to the table; the modules and the scheduler base class's methods are the real pre-1.0 names.
"""

from __future__ import annotations

import bisect
import importlib
import random
import re
import sys
import warnings
from pathlib import Path

import pluggy
import pytest
from packaging.version import Version

import scheduling_sim
from pagoda import ConfigError, SamplingParams, deprecation, hookimpl, hookspecs
from pagoda.deprecation import ATTRIBUTE, DEPRECATIONS, HOOK, METHOD, MODULE, OVERRIDE, Deprecation
from pagoda.plugin_manager import COMPONENT_HOOKS, PluginManager
from pagoda.plugins.schedulers.base import FCFSScheduler, TokenBudgetScheduler
from pagoda.plugins.schedulers.priority import PriorityScheduler
from pagoda.sampler import Sampler
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput
from pagoda.testing import SimRunner, check_scheduler
from pagoda.version import PLUGIN_API_VERSION
from tiny_models import tiny_llm, write_tiny_checkpoint

CHANGELOG = Path(__file__).resolve().parents[1] / "docs" / "plugin-api-changelog.md"
BASE_CLASSES = {"TokenBudgetScheduler": TokenBudgetScheduler, "Sampler": Sampler}


# ---- the table ------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", DEPRECATIONS, ids=lambda d: d.old_name)
def test_every_deprecated_name_is_removed_in_a_later_api_version_than_this_one(entry):
    since, removed_in, current = Version(entry.since), Version(entry.removed_in), Version(PLUGIN_API_VERSION)
    assert current < removed_in, (
        f"{entry.old_name} was due for removal in plugin API {entry.removed_in} and pagoda's is "
        f"{PLUGIN_API_VERSION}: delete its entry in pagoda.deprecation.DEPRECATIONS, the code honouring it "
        "and its row in docs/plugin-api-changelog.md")
    assert since <= current
    # it keeps working through at least one whole minor version after the one that deprecated it
    assert removed_in >= Version(f"{since.major}.{since.minor + 2}")


@pytest.mark.parametrize("entry", DEPRECATIONS, ids=lambda d: d.old_name)
def test_every_deprecated_name_points_at_a_name_that_exists(entry):
    if entry.kind == HOOK:
        assert hasattr(hookspecs, entry.new)
    elif entry.kind == METHOD:
        assert entry.owner in COMPONENT_HOOKS
    elif entry.kind == OVERRIDE:
        base = BASE_CLASSES[entry.owner]
        assert callable(getattr(base, entry.new))
        # unless refused, the base either still calls the old name or keeps it for callers: an override of
        # it is never silently ignored
        assert entry.refused or callable(getattr(base, entry.old))
    elif entry.kind == MODULE:
        importlib.import_module(entry.new)
    else:
        assert entry.kind == ATTRIBUTE
        module, _, name = entry.new.rpartition(".")
        assert hasattr(importlib.import_module(module), name)
        assert entry.old.rpartition(".")[0] in {d.old for d in DEPRECATIONS if d.kind == MODULE}


def test_the_changelog_lists_every_deprecated_name_with_its_versions():
    rows = [line for line in CHANGELOG.read_text().splitlines() if line.startswith("| `")]
    for entry in DEPRECATIONS:
        row = next((r for r in rows if r.startswith(f"| `{entry.old_name}`")), None)
        assert row is not None, f"docs/plugin-api-changelog.md has no row for {entry.old_name}"
        assert f"`{entry.new}`" in row and entry.since in row and entry.removed_in in row, row


# ---- modules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("old_module, name, new_module, new_name", [
    ("pagoda.request", "Request", "pagoda.sequence", "Sequence"),
    ("pagoda.request", "RequestStatus", "pagoda.sequence", "SequenceStatus"),
    ("pagoda.kv_cache", "PagedKVCacheManager", "pagoda.kv_blocks", "PagedKVCacheManager"),
    ("pagoda.kv_cache", "hash_block", "pagoda.kv_blocks", "hash_block"),
    ("pagoda.attention_batch", "AttentionBatch", "pagoda.step", "AttentionBatch"),
    ("pagoda.plugins.schedulers.fcfs", "FCFSScheduler", "pagoda.plugins.schedulers.base", "FCFSScheduler"),
])
def test_a_moved_module_imports_with_a_warning_and_gives_the_new_objects(monkeypatch, old_module, name,
                                                                          new_module, new_name):
    monkeypatch.delitem(sys.modules, old_module, raising=False)  # import it afresh
    with pytest.warns(DeprecationWarning,
                      match=rf"module {re.escape(old_module)} is deprecated in pagoda plugin API 1\.0 and removed in "
                            rf"1\.2: import {re.escape(new_module)} instead"):
        module = importlib.import_module(old_module)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old_module}.{name} is deprecated in pagoda plugin API "
                                                          f"1.0 and removed in 1.2: use {new_module}.{new_name}")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new_module), new_name)


def test_a_pre_1_0_request_is_a_sequence_that_runs():
    with pytest.warns(DeprecationWarning, match="pagoda.request.Request"):
        from pagoda.request import Request, RequestStatus
    request = Request("r0", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), None, 0.0, None, 0)
    scheduler = scheduling_sim.make_scheduler("fcfs")
    scheduler.add_request(request)
    scheduling_sim.run_until_done(scheduler, SimRunner(64, 4))
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 2


def test_a_name_the_moved_module_never_had_is_an_attribute_error_that_says_where_it_went():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import pagoda.kv_cache
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_thing' .* see pagoda\.kv_blocks"):
        pagoda.kv_cache.no_such_thing  # noqa: B018


# ---- methods of the scheduler base class ----------------------------------------------------------


def priority_key(req: Sequence) -> tuple:
    return (req.priority, req.arrival_time, req.request_id)


def pre_1_0_priority_policy() -> type:
    """The built-in priority policy as it was written before plugin API 1.0."""

    class PreReleasePriority(TokenBudgetScheduler):
        def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
            bisect.insort(self.waiting, request, key=priority_key)

        def _insert_running(self, request: Sequence) -> None:
            bisect.insort(self.running, request, key=priority_key)

        def _insert_swapped(self, request: Sequence) -> None:
            bisect.insort(self.swapped, request, key=priority_key)

        def _pick_victim(self, candidates: list[Sequence]) -> Sequence:
            return max(candidates, key=priority_key)

        def _running_order(self) -> list[Sequence]:
            return list(self.running)

        def _may_admit_waiting(self, request: Sequence) -> bool:
            return not self.swapped or priority_key(request) < priority_key(self.swapped[0])

        def _preempt_for_arrivals(self, out: SchedulerOutput) -> None:
            if not self.waiting or not self.running:
                return
            head = self.waiting[0]
            lower = [r for r in self.running if priority_key(r) > priority_key(head)]
            if not lower or self._fits(head):
                return
            reclaimable = sum(self.kv.num_exclusive_blocks(r.request_id) for r in lower)
            need = self._blocks_for_first_chunk(head)
            seats = self.max_num_seqs - len(self.running) + len(lower)
            if need > self.kv.num_free_blocks + reclaimable or seats < 1:
                return
            for victim in reversed(lower):
                self._preempt(victim, out)
                if self._fits(head):
                    return

        def _fits(self, req: Sequence) -> bool:
            return (len(self.running) < self.max_num_seqs
                    and self._blocks_for_first_chunk(req) <= self.kv.num_free_blocks)

        def _blocks_for_first_chunk(self, req: Sequence) -> int:
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = self._num_new_tokens(req, self.max_num_batched_tokens, num_cached)
            return self.kv.num_blocks_to_take(req, num_new, computed_blocks)

    return PreReleasePriority


def test_a_pre_1_0_policy_is_warned_about_each_private_method_it_overrides_naming_the_public_one():
    with pytest.warns(DeprecationWarning) as record:
        pre_1_0_priority_policy()
    messages = sorted(str(w.message) for w in record if "PreReleasePriority" in str(w.message))
    replaced = [("_insert_running", "running_key"), ("_insert_swapped", "running_key"),
                ("_insert_waiting", "waiting_key"), ("_may_admit_waiting", "may_admit"),
                ("_pick_victim", "choose_victim"), ("_preempt_for_arrivals", "preempt_for_arrivals"),
                ("_running_order", "running_key")]
    assert len(messages) == len(replaced)
    for message, (old, new) in zip(messages, replaced):
        assert re.search(rf"overrides TokenBudgetScheduler\.{old}, deprecated in pagoda plugin API 1\.0 and "
                         rf"removed in 1\.2: override {new} instead", message), message


def schedule_trace(policy: str, preemption_mode: str, seed: int) -> tuple[list, int]:
    """Every step's (requests, tokens, preempted) for a random stream of prioritised arrivals into a cache
    too small for them all, and the number of preemptions."""
    rng = random.Random(seed)
    num_swap_blocks = 16 if preemption_mode == "swap" else 0
    scheduler = scheduling_sim.make_scheduler(policy, num_blocks=16, block_size=4, budget=24, max_num_seqs=6,
                                              preemption_mode=preemption_mode, num_swap_blocks=num_swap_blocks)
    runner = SimRunner(16, 4, num_swap_blocks)
    trace = []
    for i in range(40):
        if i < 30 and rng.random() < 0.5:
            prompt = [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 20))]
            scheduler.add_request(scheduling_sim.make_request(f"r{i}", prompt, max_tokens=rng.randrange(2, 12),
                                                              priority=rng.randrange(3), arrival=float(i)))
        sched = scheduling_sim.step(scheduler, runner)
        trace.append(([r.request_id for r in sched.requests], list(sched.num_new_tokens),
                      [r.request_id for r in sched.preempted]))
    scheduling_sim.run_until_done(scheduler, runner)
    return trace, scheduler.num_preemptions


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_pre_1_0_priority_policy_schedules_exactly_like_the_built_in_one(monkeypatch, preemption_mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = pre_1_0_priority_policy()
    monkeypatch.setitem(scheduling_sim.POLICIES, "pre-1.0 priority", policy)
    num_preemptions = num_preempt_calls = 0
    for seed in range(4):
        expected, _ = schedule_trace("priority", preemption_mode, seed)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always", DeprecationWarning)
            trace, n = schedule_trace("pre-1.0 priority", preemption_mode, seed)
        assert trace == expected
        num_preemptions += n
        num_preempt_calls += sum("TokenBudgetScheduler._preempt is deprecated" in str(w.message) for w in record)
    assert num_preemptions > 0 and num_preempt_calls > 0  # arrivals preempted running work too


def test_a_pre_1_0_priority_policy_passes_the_conformance_kit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        check_scheduler(pre_1_0_priority_policy(), seeds=1)


def test_calling_the_renamed_preempt_warns_and_preempts():
    scheduler = scheduling_sim.make_scheduler("fcfs")
    runner = SimRunner(64, 4)
    request = scheduling_sim.make_request("r0", [5, 6, 7], max_tokens=4)
    scheduler.add_request(request)
    scheduling_sim.step(scheduler, runner)
    out = SchedulerOutput()
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\._preempt is deprecated .* removed in "
                                                r"1\.2: call preempt"):
        scheduler._preempt(request, out)
    assert out.preempted == [request] and scheduler.waiting == [request]
    scheduling_sim.run_until_done(scheduler, runner)
    assert request.num_output_tokens == 4


def pre_1_0_shortest_job_first() -> type:
    """contrib/pagoda-sjf's policy as it was written before plugin API 1.0: only ``_insert_waiting``."""

    def job_size(request: Sequence) -> tuple[int, float]:
        return (request.num_prompt_tokens, request.arrival_time)

    class PreReleaseShortestJobFirst(TokenBudgetScheduler):
        def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
            if front:
                self.waiting.insert(0, request)
                return
            first_new = next((i for i, r in enumerate(self.waiting) if r.num_preemptions == 0), len(self.waiting))
            index = bisect.bisect_right(self.waiting, job_size(request), lo=first_new, key=job_size)
            self.waiting.insert(index, request)

    return PreReleaseShortestJobFirst


def test_a_pre_1_0_insert_waiting_override_still_orders_the_queue_and_passes_the_conformance_kit(monkeypatch):
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\._insert_waiting, .* removed in "
                                                r"1\.2: override waiting_key instead"):
        policy = pre_1_0_shortest_job_first()
    monkeypatch.setitem(scheduling_sim.POLICIES, "pre-1.0 sjf", policy)
    scheduler = scheduling_sim.make_scheduler("pre-1.0 sjf", max_num_seqs=1)
    for i, length in enumerate([30, 10, 20]):
        scheduler.add_request(scheduling_sim.make_request(f"len{length}", list(range(100, 100 + length)),
                                                          max_tokens=2, arrival=float(i)))
    runner, finished = SimRunner(64, 4), []
    while scheduler.has_unfinished_requests():
        scheduling_sim.step(scheduler, runner)
        finished += [r.request_id for r in scheduler.drain_finished()]
    assert finished == ["len10", "len20", "len30"]
    check_scheduler(policy, seeds=1)


def test_an_override_of_the_renamed_preempt_is_called_and_may_call_super_by_the_old_name(monkeypatch):
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\._preempt, .* override preempt"):
        class LoggingPreemptions(FCFSScheduler):
            def _preempt(self, request, out):
                self.preempted_ids = getattr(self, "preempted_ids", []) + [request.request_id]
                super()._preempt(request, out)

    monkeypatch.setitem(scheduling_sim.POLICIES, "logging", LoggingPreemptions)
    scheduler = scheduling_sim.make_scheduler("logging", num_blocks=6, block_size=4)
    for i in range(3):
        scheduler.add_request(scheduling_sim.make_request(f"r{i}", [100 + i] * 6, max_tokens=8, arrival=float(i)))
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\._preempt is deprecated"):
        scheduling_sim.run_until_done(scheduler, SimRunner(6, 4))
    assert scheduler.num_preemptions > 0 and len(scheduler.preempted_ids) == scheduler.num_preemptions
    assert all(r.num_output_tokens == 8 for r in scheduler.drain_finished())


def test_super_by_the_old_name_reaches_a_parent_written_with_the_new_names(monkeypatch):
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\._pick_victim"):
        class PreReleaseSubclassOfPriority(PriorityScheduler):
            def _pick_victim(self, candidates):
                return super()._pick_victim(candidates)

    monkeypatch.setitem(scheduling_sim.POLICIES, "subclass of priority", PreReleaseSubclassOfPriority)
    scheduler = scheduling_sim.make_scheduler("subclass of priority")
    candidates = [scheduling_sim.make_request(f"p{p}", [1, 2], priority=p) for p in (2, 5, 1)]
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\._pick_victim is deprecated .* call "
                                                r"choose_victim"):
        assert scheduler.choose_victim(candidates).request_id == "p5"  # PriorityScheduler's choice, not the last


def test_overriding_a_method_whose_arguments_changed_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError, match=r"overrides Sampler\._apply_bias_and_min_tokens, deprecated in pagoda "
                                        r"plugin API 1\.1 and removed in 1\.3, and its arguments changed: "
                                        r"apply_bias_and_bans\(logits, requests, banned\) .* override "
                                        r"apply_bias_and_bans instead"):
        class PreReleaseBias(Sampler):
            def _apply_bias_and_min_tokens(self, logits, requests):
                pass


def test_a_policy_defining_both_the_old_and_the_new_name_is_refused():
    with pytest.raises(TypeError, match=r"defines both TokenBudgetScheduler\._pick_victim, .* and choose_victim, "
                                        r"which replaces it; delete _pick_victim"):
        class Undecided(TokenBudgetScheduler):
            def _pick_victim(self, candidates):
                return candidates[0]

            def choose_victim(self, candidates):
                return candidates[-1]


def test_a_policy_using_only_public_names_is_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)

        class Oldest(TokenBudgetScheduler):
            def choose_victim(self, candidates):
                return candidates[0]


# ---- hooks and component methods (renames the tests add to the table) ------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def add_deprecation(monkeypatch, entry: Deprecation) -> None:
    monkeypatch.setattr(deprecation, "DEPRECATIONS", DEPRECATIONS + (entry,))


class CountingSampler:
    """The default sampler, counting its calls."""

    def __init__(self, model_config) -> None:
        from pagoda.sampler import Sampler

        self.sampler = Sampler(model_config)
        self.calls = 0

    def __call__(self, logits, requests):
        self.calls += 1
        return self.sampler(logits, requests)


class OldHookPlugin:
    """A plugin implementing ``pagoda_samplers`` under the name it had before a (test-only) rename."""

    @hookimpl
    def pagoda_sampling_methods(self):
        return {"counting": CountingSampler}


@pytest.fixture
def renamed_sampler_hook(monkeypatch):
    add_deprecation(monkeypatch, Deprecation(HOOK, "pagoda_sampling_methods", "pagoda_samplers", "1.0", "1.2"))


def test_a_hook_implemented_under_its_old_name_is_used_under_the_new_one(renamed_sampler_hook, tiny_dir):
    pm = PluginManager().load()
    with pytest.warns(DeprecationWarning, match=r"plugin 'old-hooks' implements the hook pagoda_sampling_methods, "
                                                r"deprecated in pagoda plugin API 1\.0 and removed in 1\.2: rename "
                                                r"it to pagoda_samplers"):
        pm.register(OldHookPlugin(), name="old-hooks", dist="test")
    assert pm.get("pagoda_samplers", "counting", "sampler").plugin == "old-hooks"
    pm.pm.check_pending()  # no hook is left without a spec
    llm = tiny_llm(tiny_dir, plugin_manager=pm, sampler="counting")
    outputs = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
    assert llm.engine.runner.sampler.calls == 4


def test_an_installed_plugin_with_an_old_hook_name_loads_with_a_warning_naming_it(renamed_sampler_hook, tmp_path,
                                                                                  monkeypatch):
    # an installed distribution as pip leaves it: the module, and a dist-info with its entry point
    (tmp_path / "old_hook_sampler.py").write_text(
        "import pagoda\n"
        "from pagoda.sampler import Sampler\n\n"
        "@pagoda.hookimpl\n"
        "def pagoda_sampling_methods():\n"
        "    return {'old-hook-default': Sampler}\n")
    info = tmp_path / "old_hook_sampler-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: old-hook-sampler\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pagoda.plugins]\noldhooks = old_hook_sampler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "old_hook_sampler", raising=False)
    monkeypatch.delenv("PAGODA_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGODA_PLUGIN_AUTOLOAD", raising=False)
    with pytest.warns(DeprecationWarning, match=r"plugin 'oldhooks' implements the hook pagoda_sampling_methods, "
                                                r".* rename it to pagoda_samplers"):
        pm = PluginManager().load()
    component = pm.get("pagoda_samplers", "old-hook-default", "sampler")
    assert (component.plugin, component.dist) == ("oldhooks", "old-hook-sampler 0.1")
    assert all(f.name != "oldhooks" for f in pm.failures)
    sys.modules.pop("old_hook_sampler", None)  # imported by load(), from a folder that is gone after the test


def test_without_the_rename_pluggy_would_ignore_the_old_hook_name():
    pm = pluggy.PluginManager("pagoda")
    pm.add_hookspecs(hookspecs)
    pm.register(OldHookPlugin(), name="old-hooks")
    assert pm.hook.pagoda_samplers() == []
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'pagoda_sampling_methods'"):
        pm.check_pending()


def test_a_plugin_implementing_both_the_old_and_the_new_hook_is_refused(renamed_sampler_hook):
    class Both(OldHookPlugin):
        @hookimpl
        def pagoda_samplers(self):
            return {"counting": CountingSampler}

    pm = PluginManager().load()
    with pytest.raises(ConfigError, match="plugin 'both' implements both pagoda_sampling_methods and "
                                          "pagoda_samplers, which replaces it; delete pagoda_sampling_methods"):
        pm.register(Both(), name="both")


class OldNamedLoader:
    """The dummy loader, with ``load_weights`` under the name it had before a (test-only) rename."""

    def __init__(self, model_config, loads: list) -> None:
        from pagoda.loader import DummyLoader

        self.loader = DummyLoader(model_config)
        self.loads = loads

    def fill(self, model) -> None:
        self.loads.append(model)
        self.loader.load_weights(model)


def test_a_component_with_a_method_under_its_old_name_is_called_through_it(monkeypatch, tiny_dir):
    add_deprecation(monkeypatch, Deprecation(METHOD, "fill", "load_weights", "1.0", "1.2", "pagoda_model_loaders"))
    loads = []

    class OldLoaderPlugin:
        @hookimpl
        def pagoda_model_loaders(self):
            return {"old-dummy": lambda model_config: OldNamedLoader(model_config, loads)}

    pm = PluginManager().load()
    pm.register(OldLoaderPlugin(), name="old-loader", dist="test")
    with pytest.warns(DeprecationWarning, match=r"'old-dummy' \(OldNamedLoader, from pagoda_model_loaders\) has the "
                                                r"method fill, deprecated in pagoda plugin API 1\.0 and removed in "
                                                r"1\.2: rename it to load_weights"):
        llm = tiny_llm(tiny_dir, plugin_manager=pm, load_format="old-dummy")
    assert len(loads) == 1
    outputs = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_a_component_that_has_the_new_name_is_left_alone(monkeypatch):
    add_deprecation(monkeypatch, Deprecation(METHOD, "fill", "load_weights", "1.0", "1.2", "pagoda_model_loaders"))

    class Both:
        def fill(self, model):
            raise AssertionError("the old name must not be used")

        def load_weights(self, model):
            pass

    component = Both()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert deprecation.adapt_renamed_methods(component, "pagoda_model_loaders", "both") is component
    assert component.load_weights.__func__ is Both.load_weights


# ---- methods of the sampler base class -------------------------------------------------------------

FAVOURITE_TOKEN = 7


def pre_1_1_penalty_sampler() -> type:
    """A sampler plugin as written for plugin API 1.0: it overrides the then-private ``_apply_penalties``
    and calls the original through ``super()``."""

    class FavouriteTokenSampler(Sampler):
        def _apply_penalties(self, logits, requests):
            super()._apply_penalties(logits, requests)
            logits[:, FAVOURITE_TOKEN] += 1e4

    return FavouriteTokenSampler


def test_a_1_0_sampler_overriding_a_private_step_is_warned_about_and_still_used(tiny_dir):
    with pytest.warns(DeprecationWarning, match=r"overrides Sampler\._apply_penalties, deprecated in pagoda plugin "
                                                r"API 1\.1 and removed in 1\.3: override apply_penalties instead"):
        sampler_cls = pre_1_1_penalty_sampler()

    class Plugin:
        @hookimpl
        def pagoda_samplers(self):
            return {"favourite": sampler_cls}

    pm = PluginManager().load()
    pm.register(Plugin(), name="favourite-sampler", dist="test")
    llm = tiny_llm(tiny_dir, plugin_manager=pm, sampler="favourite")
    assert llm.engine.runner.sampler.samples_standard_distribution is False  # it changes the distribution
    params = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=0.5, ignore_eos=True)
    with pytest.warns(DeprecationWarning, match=r"Sampler\._apply_penalties is deprecated .* call apply_penalties"):
        outputs = llm.generate("hi", params, use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == [FAVOURITE_TOKEN] * 4
