"""Deprecated names of the plugin API keep working, with a DeprecationWarning naming the old name, the new
one and the version that removes it, until that version; a shim that outlives it fails this suite. Once
removed, a name fails loudly: a removed module does not import, and a subclass overriding a removed method
the base no longer calls is refused.

Only the sampler's 1.0 names are deprecated now, so the other mechanisms are shown on renames the tests
add to the table (hooks and component methods in tests/test_deprecation_engine.py).
"""

from __future__ import annotations

import bisect
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
from packaging.version import Version

import scheduling_sim
from pagoda import hookspecs
from pagoda.registry import deprecation
from pagoda.registry.deprecation import (ATTRIBUTE, CALLED, DEPRECATIONS, HOOK, METHOD, MODULE, OVERRIDE,
                                         REMOVED_OVERRIDES, Deprecation, renamed_method)
from pagoda.plugins.schedulers.base import FCFSScheduler, TokenBudgetScheduler
from pagoda.plugins.schedulers.priority import PriorityScheduler
from pagoda.registry.plugin_manager import COMPONENT_HOOKS
from pagoda.sampling.sampler import Sampler
from pagoda.sequence import Sequence
from pagoda.step import SchedulerOutput
from pagoda.testing import SimRunner, check_scheduler
from pagoda.version import PLUGIN_API_VERSION

CHANGELOG = Path(__file__).resolve().parents[1] / "docs" / "plugin-api-changelog.md"
BASE_CLASSES = {"TokenBudgetScheduler": TokenBudgetScheduler, "Sampler": Sampler}
CALLED_CLASSES = {"Sequence": Sequence}  # contract classes plugins call but do not subclass
# the modules removed in 1.2, and where their names live now
REMOVED_MODULES = {"pagoda.request": "pagoda.sequence", "pagoda.kv_cache": "pagoda.kv.blocks",
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
        f"{PLUGIN_API_VERSION}: delete its entry in pagoda.registry.deprecation.DEPRECATIONS, the code honouring it "
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
    elif entry.kind == CALLED:
        owner = CALLED_CLASSES[entry.owner]
        assert callable(getattr(owner, entry.new)) and callable(getattr(owner, entry.old))
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
        "from pagoda.registry.deprecation import deprecated_module\n\n__getattr__ = deprecated_module(__name__)\n")
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
def test_a_subclass_overriding_a_removed_method_is_refused_naming_its_replacement(entry):
    with pytest.raises(TypeError, match=rf"overrides {re.escape(entry.old_name)}, which {entry.owner} no longer "
                                        rf"calls \(it was deprecated in pagoda plugin API {re.escape(entry.since)} and "
                                        rf"removed in {re.escape(entry.removed_in)}\): override {entry.new} instead"):
        base = FCFSScheduler if entry.owner == "TokenBudgetScheduler" else BASE_CLASSES[entry.owner]
        type("PreReleaseSubclass", (base,), {entry.old: lambda self, *args: None})


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


def test_overriding_a_sampler_step_removed_in_1_3_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError, match=r"overrides Sampler\._apply_bias_and_min_tokens, which Sampler no longer "
                                        r"calls \(it was deprecated in pagoda plugin API 1\.1 and removed in "
                                        r"1\.3\): override apply_bias_and_bans instead"):
        class PreReleaseBias(Sampler):
            def _apply_bias_and_min_tokens(self, logits, requests):
                pass


def test_a_policy_using_only_public_names_is_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)

        class Oldest(TokenBudgetScheduler):
            def choose_victim(self, candidates):
                return candidates[0]


MOVED_IN_1_3 = {"pagoda.kv_blocks": "pagoda.kv.blocks", "pagoda.layers.linear": "pagoda.modeling.layers.linear",
                "pagoda.plugin_manager": "pagoda.registry.plugin_manager", "pagoda.llm": "pagoda.engine.llm",
                "pagoda.sampler": "pagoda.sampling.sampler"}


@pytest.mark.parametrize("old", sorted(MOVED_IN_1_3))
def test_a_module_moved_in_1_3_no_longer_imports_under_its_old_name_since_1_5(monkeypatch, old):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert importlib.import_module(MOVED_IN_1_3[old])
    removals = changelog_section("1.5").split("Removed", 1)[1]
    package = old if old != "pagoda.layers.linear" else "pagoda.layers"
    assert f"`{package}`" in removals


def test_a_name_that_never_existed_is_still_a_module_not_found_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pagoda.kv_blocks_and_more")


def test_sequence_append_output_token_warns_and_appends_through_append_output_tokens():
    from pagoda.sampling_params import SamplingParams

    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=4))
    with pytest.warns(DeprecationWarning, match=r"append_output_token is deprecated .* 1\.4 and removed in 2\.0"):
        seq.append_output_token(7)
    assert seq.output_token_ids == [7] and seq.all_token_ids == [1, 2, 7]
