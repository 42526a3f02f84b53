"""Deprecated names of the plugin API keep working, with a DeprecationWarning naming the old name, the new
one and the version that removes it, until that version; a shim that outlives it fails this suite. Once
removed, a name fails loudly: a removed module does not import, and a subclass overriding a removed method
the base no longer calls is refused.

Only the sampler's 1.0 names are deprecated now, so the other mechanisms are shown on renames the tests
add to the table.
"""

from __future__ import annotations

import bisect
import importlib
import re
import sys
import warnings
from pathlib import Path

import pluggy
import pytest
from packaging.version import Version

import scheduling_sim
from pagoda import ConfigError, SamplingParams, deprecation, hookimpl, hookspecs
from pagoda.deprecation import (ATTRIBUTE, DEPRECATIONS, HOOK, METHOD, MODULE, OVERRIDE, REMOVED_OVERRIDES,
                                Deprecation, renamed_method)
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
# the modules removed in 1.2, and where their names live now
REMOVED_MODULES = {"pagoda.request": "pagoda.sequence", "pagoda.kv_cache": "pagoda.kv_blocks",
                   "pagoda.attention_batch": "pagoda.step",
                   "pagoda.plugins.schedulers.fcfs": "pagoda.plugins.schedulers.base"}


def add_deprecation(monkeypatch, *entries: Deprecation) -> None:
    monkeypatch.setattr(deprecation, "DEPRECATIONS", deprecation.DEPRECATIONS + entries)


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


@pytest.mark.parametrize("entry", REMOVED_OVERRIDES, ids=lambda d: d.old_name)
def test_every_removed_override_is_gone_from_its_base_and_named_with_its_replacement_in_the_changelog(entry):
    assert Version(entry.removed_in) <= Version(PLUGIN_API_VERSION)
    base = BASE_CLASSES[entry.owner]
    assert not hasattr(base, entry.old) and callable(getattr(base, entry.new))
    assert entry.old_name not in {d.old_name for d in DEPRECATIONS}
    removals = changelog_section(entry.removed_in).split("Removed", 1)[1]
    assert f"`{entry.old_name}`" in removals and f"`{entry.new}`" in removals


def changelog_section(version: str) -> str:
    text = CHANGELOG.read_text()
    start = text.index(f"\n## {version}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


# ---- modules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", sorted(REMOVED_MODULES))
def test_a_removed_module_no_longer_imports_and_the_changelog_says_what_replaces_it(monkeypatch, module):
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"No module named '{module}'")):
        importlib.import_module(module)
    removals = changelog_section("1.2").split("Removed", 1)[1]
    assert f"`{module}`" in removals and f"`{REMOVED_MODULES[module]}`" in removals


@pytest.fixture
def moved_module(monkeypatch, tmp_path):
    """``pagoda_test_requests``, a (test-only) module whose names moved to :mod:`pagoda.sequence`, where
    ``Request`` is called ``Sequence``: the stub left under the old name, as pagoda's own were."""
    (tmp_path / "pagoda_test_requests.py").write_text(
        "from pagoda.deprecation import deprecated_module\n\n__getattr__ = deprecated_module(__name__)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pagoda_test_requests", raising=False)
    add_deprecation(monkeypatch, Deprecation(MODULE, "pagoda_test_requests", "pagoda.sequence", "1.1", "1.3"),
                    Deprecation(ATTRIBUTE, "pagoda_test_requests.Request", "pagoda.sequence.Sequence", "1.1", "1.3"))
    yield "pagoda_test_requests"
    sys.modules.pop("pagoda_test_requests", None)  # imported from a folder that is gone after the test


@pytest.mark.parametrize("name, new_name", [("Request", "Sequence"), ("SequenceStatus", "SequenceStatus")])
def test_a_moved_module_imports_with_a_warning_and_gives_the_new_objects(moved_module, name, new_name):
    with pytest.warns(DeprecationWarning,
                      match=r"module pagoda_test_requests is deprecated in pagoda plugin API 1\.1 and removed in "
                            r"1\.3: import pagoda\.sequence instead"):
        module = importlib.import_module(moved_module)
    with pytest.warns(DeprecationWarning, match=re.escape(f"pagoda_test_requests.{name} is deprecated in pagoda "
                                                          f"plugin API 1.1 and removed in 1.3: use "
                                                          f"pagoda.sequence.{new_name}")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module("pagoda.sequence"), new_name)


def test_a_name_the_moved_module_never_had_is_an_attribute_error_that_says_where_it_went(moved_module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(moved_module)
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_thing' .* see pagoda\.sequence"):
        module.no_such_thing  # noqa: B018


# ---- methods of the scheduler base class ----------------------------------------------------------


@pytest.mark.parametrize("entry", REMOVED_OVERRIDES, ids=lambda d: d.old_name)
def test_a_policy_overriding_a_removed_method_is_refused_naming_its_replacement(entry):
    with pytest.raises(TypeError, match=rf"overrides {re.escape(entry.old_name)}, which {entry.owner} no longer "
                                        rf"calls \(it was deprecated in pagoda plugin API 1\.0 and removed in "
                                        rf"1\.2\): override {entry.new} instead"):
        type("PreReleasePolicy", (FCFSScheduler,), {entry.old: lambda self, *args: None})


@pytest.fixture
def renamed_scheduler_methods(monkeypatch):
    """Two (test-only) plain renames of the scheduler base's methods, ``evict`` to ``preempt`` and
    ``select_victim`` to ``choose_victim``: the base keeps each old name for callers."""
    add_deprecation(monkeypatch, Deprecation(OVERRIDE, "evict", "preempt", "1.1", "1.3", "TokenBudgetScheduler"),
                    Deprecation(OVERRIDE, "select_victim", "choose_victim", "1.1", "1.3", "TokenBudgetScheduler"))
    for old in ("evict", "select_victim"):
        monkeypatch.setattr(TokenBudgetScheduler, old, renamed_method("TokenBudgetScheduler", old), raising=False)


def test_calling_a_renamed_method_warns_and_runs_the_new_one(renamed_scheduler_methods):
    scheduler = scheduling_sim.make_scheduler("fcfs")
    runner = SimRunner(64, 4)
    request = scheduling_sim.make_request("r0", [5, 6, 7], max_tokens=4)
    scheduler.add_request(request)
    scheduling_sim.step(scheduler, runner)
    out = SchedulerOutput()
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\.evict is deprecated in pagoda plugin API "
                                                r"1\.1 and removed in 1\.3: call preempt"):
        scheduler.evict(request, out)
    assert out.preempted == [request] and scheduler.waiting == [request]
    scheduling_sim.run_until_done(scheduler, runner)
    assert request.num_output_tokens == 4


def test_an_override_under_a_renamed_name_is_called_and_may_call_super_by_the_old_name(renamed_scheduler_methods,
                                                                                       monkeypatch):
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\.evict, .* override preempt"):
        class LoggingPreemptions(FCFSScheduler):
            def evict(self, request, out):
                self.preempted_ids = getattr(self, "preempted_ids", []) + [request.request_id]
                super().evict(request, out)

    monkeypatch.setitem(scheduling_sim.POLICIES, "logging", LoggingPreemptions)
    scheduler = scheduling_sim.make_scheduler("logging", num_blocks=6, block_size=4)
    for i in range(3):
        scheduler.add_request(scheduling_sim.make_request(f"r{i}", [100 + i] * 6, max_tokens=8, arrival=float(i)))
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\.evict is deprecated"):
        scheduling_sim.run_until_done(scheduler, SimRunner(6, 4))
    assert scheduler.num_preemptions > 0 and len(scheduler.preempted_ids) == scheduler.num_preemptions
    assert all(r.num_output_tokens == 8 for r in scheduler.drain_finished())


def test_super_by_the_old_name_reaches_a_parent_written_with_the_new_names(renamed_scheduler_methods, monkeypatch):
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\.select_victim"):
        class OldNamedSubclassOfPriority(PriorityScheduler):
            def select_victim(self, candidates):
                return super().select_victim(candidates)

    monkeypatch.setitem(scheduling_sim.POLICIES, "subclass of priority", OldNamedSubclassOfPriority)
    scheduler = scheduling_sim.make_scheduler("subclass of priority")
    candidates = [scheduling_sim.make_request(f"p{p}", [1, 2], priority=p) for p in (2, 5, 1)]
    with pytest.warns(DeprecationWarning, match=r"TokenBudgetScheduler\.select_victim is deprecated .* call "
                                                r"choose_victim"):
        assert scheduler.choose_victim(candidates).request_id == "p5"  # PriorityScheduler's choice, not the last


def test_a_policy_defining_both_the_old_and_the_new_name_is_refused(renamed_scheduler_methods):
    with pytest.raises(TypeError, match=r"defines both TokenBudgetScheduler\.select_victim, .* and choose_victim, "
                                        r"which replaces it; delete select_victim"):
        class Undecided(TokenBudgetScheduler):
            def select_victim(self, candidates):
                return candidates[0]

            def choose_victim(self, candidates):
                return candidates[-1]


def shortest_job_first_by_insert_waiting() -> type:
    """contrib/pagoda-sjf's policy written against the base's private ``_insert_waiting`` helper."""

    def job_size(request: Sequence) -> tuple[int, float]:
        return (request.num_prompt_tokens, request.arrival_time)

    class InsertWaitingShortestJobFirst(TokenBudgetScheduler):
        def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
            if front:
                self.waiting.insert(0, request)
                return
            first_new = next((i for i, r in enumerate(self.waiting) if r.num_preemptions == 0), len(self.waiting))
            index = bisect.bisect_right(self.waiting, job_size(request), lo=first_new, key=job_size)
            self.waiting.insert(index, request)

    return InsertWaitingShortestJobFirst


def test_an_override_of_a_deprecated_helper_the_base_still_calls_is_warned_about_and_still_used(monkeypatch):
    # a (test-only) deprecation of the queue helper: the base calls it itself, so the override needs no adapting
    add_deprecation(monkeypatch, Deprecation(OVERRIDE, "_insert_waiting", "waiting_key", "1.1", "1.3",
                                             "TokenBudgetScheduler"))
    with pytest.warns(DeprecationWarning, match=r"overrides TokenBudgetScheduler\._insert_waiting, .* removed in "
                                                r"1\.3: override waiting_key instead"):
        policy = shortest_job_first_by_insert_waiting()
    monkeypatch.setitem(scheduling_sim.POLICIES, "sjf by helper", policy)
    scheduler = scheduling_sim.make_scheduler("sjf by helper", max_num_seqs=1)
    for i, length in enumerate([30, 10, 20]):
        scheduler.add_request(scheduling_sim.make_request(f"len{length}", list(range(100, 100 + length)),
                                                          max_tokens=2, arrival=float(i)))
    runner, finished = SimRunner(64, 4), []
    while scheduler.has_unfinished_requests():
        scheduling_sim.step(scheduler, runner)
        finished += [r.request_id for r in scheduler.drain_finished()]
    assert finished == ["len10", "len20", "len30"]
    check_scheduler(policy, seeds=1)


def test_overriding_a_method_whose_arguments_changed_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError, match=r"overrides Sampler\._apply_bias_and_min_tokens, deprecated in pagoda "
                                        r"plugin API 1\.1 and removed in 1\.3, and its arguments changed: "
                                        r"apply_bias_and_bans\(logits, requests, banned\) .* override "
                                        r"apply_bias_and_bans instead"):
        class PreReleaseBias(Sampler):
            def _apply_bias_and_min_tokens(self, logits, requests):
                pass


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
    add_deprecation(monkeypatch, Deprecation(HOOK, "pagoda_sampling_methods", "pagoda_samplers", "1.1", "1.3"))


def test_a_hook_implemented_under_its_old_name_is_used_under_the_new_one(renamed_sampler_hook, tiny_dir):
    pm = PluginManager().load()
    with pytest.warns(DeprecationWarning, match=r"plugin 'old-hooks' implements the hook pagoda_sampling_methods, "
                                                r"deprecated in pagoda plugin API 1\.1 and removed in 1\.3: rename "
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
    add_deprecation(monkeypatch, Deprecation(METHOD, "fill", "load_weights", "1.1", "1.3", "pagoda_model_loaders"))
    loads = []

    class OldLoaderPlugin:
        @hookimpl
        def pagoda_model_loaders(self):
            return {"old-dummy": lambda model_config: OldNamedLoader(model_config, loads)}

    pm = PluginManager().load()
    pm.register(OldLoaderPlugin(), name="old-loader", dist="test")
    with pytest.warns(DeprecationWarning, match=r"'old-dummy' \(OldNamedLoader, from pagoda_model_loaders\) has the "
                                                r"method fill, deprecated in pagoda plugin API 1\.1 and removed in "
                                                r"1\.3: rename it to load_weights"):
        llm = tiny_llm(tiny_dir, plugin_manager=pm, load_format="old-dummy")
    assert len(loads) == 1
    outputs = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_a_component_that_has_the_new_name_is_left_alone(monkeypatch):
    add_deprecation(monkeypatch, Deprecation(METHOD, "fill", "load_weights", "1.1", "1.3", "pagoda_model_loaders"))

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
