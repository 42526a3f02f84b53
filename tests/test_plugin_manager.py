"""The plugin manager: built-ins, entry points of installed distributions, names, errors, switches.

Third-party plugins here are real installed distributions in the form pip leaves them: a
``*.dist-info`` directory with METADATA and entry_points.txt next to the module, in a directory
put on ``sys.path``. ``importlib.metadata`` finds them exactly as it finds pip-installed ones.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from pagoda import ConfigError, SamplingParams, hookimpl
from pagoda.registry.plugin_manager import BUILTIN_DIST, PluginManager
from serve_process import run_pagoda_here
from tiny_models import tiny_llm, write_tiny_checkpoint


SCHEDULER_PLUGIN = """
import pagoda
from pagoda.scheduling import SchedulingPolicy

class {cls}(SchedulingPolicy):
    pass

@pagoda.hookimpl
def pagoda_schedulers():
    return {{{names}}}
"""


def install_fake_dist(site: Path, dist: str, version: str, entry_points: dict[str, str],
                      modules: dict[str, str]) -> None:
    """Lay out an installed distribution (module files + dist-info) under ``site``."""
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[pagoda.plugins]"] + [f"{name} = {module}" for name, module in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def scheduler_module(cls: str, *names: str) -> str:
    return SCHEDULER_PLUGIN.format(cls=cls, names=", ".join(f"{n!r}: {cls}" for n in names))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty site directory on sys.path; its modules are forgotten afterwards."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    monkeypatch.delenv("PAGODA_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGODA_PLUGIN_AUTOLOAD", raising=False)
    before = set(sys.modules)
    yield path
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", None) and str(path) in sys.modules[name].__file__:
            del sys.modules[name]


@pytest.fixture
def acme(site):
    install_fake_dist(site, "acme-sched", "1.2.0", {"acme": "acme_sched"},
                      {"acme_sched": scheduler_module("AcmeScheduler", "acme-lottery")})
    return site


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


# ---- built-ins -----------------------------------------------------------------------------------


def test_builtins_provide_every_documented_component(site):
    pm = PluginManager().load(autoload=False)
    assert not pm.failures
    expected = {
        "pagoda_model_loaders": {"safetensors", "dummy"},
        "pagoda_model_architectures": {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"},
        "pagoda_kv_allocators": {"paged"},
        "pagoda_schedulers": {"fcfs", "priority", "fair"},
        "pagoda_attention_backends": {"torch"},
        "pagoda_samplers": {"default"},
        "pagoda_structured_output_backends": {"xgrammar", "guidance", "llguidance"},
        "pagoda_cli_commands": {"generate", "plugins", "bench"},
    }
    for hook, names in expected.items():
        assert names <= set(pm.names(hook)), hook
    assert {c.dist for c in pm.table()} == {BUILTIN_DIST}


def test_builtin_plugins_are_exactly_the_entry_points_pyproject_declares(site):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    pm = PluginManager().load(autoload=False)
    builtin = {name for name, dist in pm.dists.items() if dist == BUILTIN_DIST}
    assert builtin == set(pyproject["project"]["entry-points"]["pagoda.plugins"])


def test_pagodas_own_entry_points_load_once(site):
    pm = PluginManager().load()
    assert not pm.failures
    assert pm.get("pagoda_schedulers", "fcfs", "scheduling_policy").dist == BUILTIN_DIST
    assert not [name for name in pm.dists if name.startswith("pagoda:")]


def test_an_entry_point_named_like_a_builtin_plugin_still_loads(site):
    install_fake_dist(site, "acme-quant", "0.2.0", {"quant": "acme_quant"},
                      {"acme_quant": scheduler_module("AcmeScheduler", "acme-fair")})
    pm = PluginManager().load()
    component = pm.get("pagoda_schedulers", "acme-fair", "scheduling_policy")
    assert (component.plugin, component.dist) == ("acme-quant:quant", "acme-quant 0.2.0")
    assert pm.get("pagoda_quant_methods", "awq", "quantization").dist == BUILTIN_DIST  # the built-in is intact


@pytest.mark.parametrize("declared", [">=1.0,<2", ">=2.0,<3", "not a range"])
def test_a_plugin_for_another_api_version_is_refused_with_its_range_and_pagodas_version(site, declared):
    from pagoda import PLUGIN_API_VERSION, __version__

    module = scheduler_module("FutureScheduler", "future") + f"\nPAGODA_PLUGIN_API = {declared!r}\n"
    install_fake_dist(site, "future-sched", "3.0", {"future": "future_sched"}, {"future_sched": module})
    pm = PluginManager().load()
    [failure] = pm.failures
    for part in ("'future'", "future-sched 3.0", declared, f"pagoda {__version__}", f"plugin API {PLUGIN_API_VERSION}",
                 "PAGODA_DISABLE_PLUGINS=future", "before 1.0 each minor version of the plugin API may break"):
        assert part in failure.error
    with pytest.raises(ConfigError, match=r"plugins that failed to load: future \(future-sched 3\.0: .*plugin API"):
        pm.get("pagoda_schedulers", "future", "scheduling_policy")


def test_a_plugin_declaring_a_range_that_admits_this_api_loads_and_shows_it(site):
    module = scheduler_module("OkScheduler", "ok") + "\nPAGODA_PLUGIN_API = '>=0.10,<0.11'\n"
    install_fake_dist(site, "ok-sched", "1.0", {"ok": "ok_sched"}, {"ok_sched": module})
    pm = PluginManager().load()
    assert not pm.failures
    assert pm.get("pagoda_schedulers", "ok", "scheduling_policy").dist == "ok-sched 1.0"
    assert pm.api_ranges["ok"] == ">=0.10,<0.11"


# ---- third-party plugins ---------------------------------------------------------------------


def test_an_installed_distribution_adds_its_components_with_its_name_and_version(acme):
    pm = PluginManager().load()
    component = pm.get("pagoda_schedulers", "acme-lottery", "scheduling_policy")
    assert component.dist == "acme-sched 1.2.0"
    assert component.plugin == "acme"
    assert component.factory.__name__ == "AcmeScheduler"


def test_a_name_two_plugins_provide_is_selected_only_by_its_qualified_names(site):
    install_fake_dist(site, "acme-sched", "1.2.0", {"acme": "acme_sched"},
                      {"acme_sched": scheduler_module("AcmeScheduler", "lottery", "acme-only")})
    install_fake_dist(site, "rival-sched", "0.3.0", {"rival": "rival_sched"},
                      {"rival_sched": scheduler_module("RivalScheduler", "lottery")})
    pm = PluginManager().load()  # loading does not fail: only selecting the plain name does
    assert pm.get("pagoda_schedulers", "acme-only", "scheduling_policy").dist == "acme-sched 1.2.0"
    assert "lottery" not in pm.names("pagoda_schedulers")
    with pytest.raises(ConfigError) as info:
        pm.get("pagoda_schedulers", "lottery", "scheduling_policy")
    msg = str(info.value)
    assert "\n" not in msg and "cannot select 'lottery' for scheduling_policy: two plugins provide the scheduler" in msg
    assert "acme-sched 1.2.0" in msg and "rival-sched 0.3.0" in msg
    assert "select one by its qualified name 'acme-sched:lottery' or 'rival-sched:lottery'" in msg  # how to choose
    assert "PAGODA_DISABLE_PLUGINS=rival" in msg
    [conflict] = pm.conflict_list()
    assert [c.plugin for c in conflict.providers] == ["acme", "rival"] and conflict.chosen is None
    assert pm.get("pagoda_schedulers", "acme-sched:lottery", "scheduling_policy").factory.__name__ == "AcmeScheduler"
    # the plugin's name, and the distribution's name as pip spells it, work as the prefix too
    assert pm.get("pagoda_schedulers", "rival:lottery", "scheduling_policy").factory.__name__ == "RivalScheduler"
    assert pm.get("pagoda_schedulers", "Rival_Sched:lottery", "scheduling_policy").dist == "rival-sched 0.3.0"
    with pytest.raises(ConfigError, match=r"no plugin of 'nobody' provides the scheduler 'lottery' for "
                                          r"scheduling_policy; it is provided as 'acme-sched:lottery' \(acme-sched "
                                          r"1\.2\.0\), 'rival-sched:lottery' \(rival-sched 0\.3\.0\)"):
        pm.get("pagoda_schedulers", "nobody:lottery", "scheduling_policy")


def test_a_plugin_shadowing_a_builtin_name_leaves_the_builtin_selected_and_says_how_to_choose_the_other(
        site, caplog):
    install_fake_dist(site, "shadow", "1.0", {"shadow": "shadow_sched"},
                      {"shadow_sched": scheduler_module("ShadowScheduler", "fcfs")})
    pm = PluginManager().load()
    with caplog.at_level("WARNING", logger="pagoda"):
        assert pm.get("pagoda_schedulers", "fcfs", "scheduling_policy").dist == BUILTIN_DIST  # nothing changed
        pm.get("pagoda_schedulers", "fcfs", "scheduling_policy")
    [record] = [r for r in caplog.records if "fcfs" in r.getMessage()]  # said once, not at every selection
    assert record.getMessage() == (
        "scheduling_policy 'fcfs': two plugins provide the scheduler 'fcfs': plugin 'schedulers' from pagoda "
        "(built-in) and plugin 'shadow' from shadow 1.0; 'fcfs' selects pagoda's own, select the other by its "
        "qualified name 'shadow:fcfs'")
    assert "fcfs" in pm.names("pagoda_schedulers")
    assert pm.get("pagoda_schedulers", "shadow:fcfs", "scheduling_policy").factory.__name__ == "ShadowScheduler"
    assert pm.get("pagoda_schedulers", "pagoda:fcfs", "scheduling_policy").dist == BUILTIN_DIST
    [conflict] = pm.conflict_list()
    assert conflict.chosen.dist == BUILTIN_DIST and [c.plugin for c in conflict.others] == ["shadow"]


def test_the_qualified_name_rule_holds_for_every_component_kind(site):
    """Samplers, allocators: a built-in's name stays the built-in's; ``dist:name`` opts in. A model architecture is
    the exception: one package's architecture overrides the built-in of its name, which ``pagoda:name`` still
    selects."""
    install_fake_dist(site, "arch-pkg", "2.0", {"arch_pkg": "arch_pkg"}, {"arch_pkg": """
        import pagoda

        class MyLlama:
            pass

        @pagoda.hookimpl
        def pagoda_model_architectures():
            return {"LlamaForCausalLM": MyLlama}

        @pagoda.hookimpl
        def pagoda_samplers():
            return {"default": MyLlama}

        @pagoda.hookimpl
        def pagoda_kv_allocators():
            return {"paged": MyLlama}
    """})
    pm = PluginManager().load()
    for hook, name in [("pagoda_model_architectures", "LlamaForCausalLM"), ("pagoda_samplers", "default"),
                       ("pagoda_kv_allocators", "paged")]:
        overrides = hook == "pagoda_model_architectures"
        assert pm.get(hook, name, "option").dist == ("arch-pkg 2.0" if overrides else BUILTIN_DIST)
        assert pm.get(hook, f"arch-pkg:{name}", "option").factory.__name__ == "MyLlama"
        assert pm.get(hook, f"pagoda:{name}", "option").dist == BUILTIN_DIST
    assert len(pm.conflict_list()) == 2
    assert [(used.dist, builtin.name) for used, builtin in pm.override_list()] == [("arch-pkg 2.0", "LlamaForCausalLM")]


def test_an_engine_and_the_kit_keep_the_builtins_when_a_package_provides_the_same_names(site, tiny_dir):
    from pagoda.testing import check_kv_allocator

    install_fake_dist(site, "shadow", "1.0", {"shadow": "shadow_sched"},
                      {"shadow_sched": scheduler_module("ShadowScheduler", "fcfs", "priority")})
    llm = tiny_llm(tiny_dir)  # the default scheduling_policy 'fcfs'
    assert type(llm.engine.scheduler.policy).__name__ == "FCFSPolicy"
    llm = tiny_llm(tiny_dir, scheduling_policy="shadow:fcfs")  # the user opts in
    assert type(llm.engine.scheduler.policy).__name__ == "ShadowScheduler"
    check_kv_allocator(paged_allocator, seeds=1)  # checks its component over pagoda's policy, whatever is installed


def paged_allocator(cache_config, num_blocks):
    from pagoda.kv.blocks import PagedKVCacheManager

    return PagedKVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)


def test_unknown_name_lists_every_available_one_with_its_distribution(acme):
    pm = PluginManager().load()
    with pytest.raises(ConfigError) as info:
        pm.get("pagoda_schedulers", "nope", "scheduling_policy")
    msg = str(info.value)
    assert "unknown scheduler 'nope' for scheduling_policy" in msg
    assert "'fcfs' (pagoda (built-in))" in msg
    assert "'priority' (pagoda (built-in))" in msg
    assert "'acme-lottery' (acme-sched 1.2.0)" in msg


def test_unknown_name_in_the_engine_config_fails_before_loading_weights(tiny_dir):
    for option, kind in [("scheduling_policy", "scheduler"), ("attention_backend", "attention backend"),
                         ("sampler", "sampler"), ("kv_allocator", "KV allocator"), ("load_format", "model loader")]:
        with pytest.raises(ConfigError, match=f"unknown {kind} 'nope' for {option}; available: '"):
            tiny_llm(tiny_dir, **{option: "nope"})


# ---- switches ------------------------------------------------------------------------------------


def test_disable_plugins_env_blocks_third_party_and_builtin_plugins(acme, monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "acme, schedulers")
    pm = PluginManager().load()
    assert pm.names("pagoda_schedulers") == []
    assert "default" in pm.names("pagoda_samplers")  # other plugins are untouched
    assert pm.blocked == {"acme": "acme-sched 1.2.0", "schedulers": BUILTIN_DIST}  # pagoda plugins lists them
    with pytest.raises(ConfigError, match="available: none; PAGODA_DISABLE_PLUGINS blocks the plugins acme "
                                          r"\(acme-sched 1.2.0\), schedulers \(pagoda \(built-in\)\)"):
        pm.get("pagoda_schedulers", "fcfs", "scheduling_policy")


@pytest.fixture
def collide(site):
    """A third-party plugin whose entry point has the name of a built-in plugin (``schedulers``)."""
    install_fake_dist(site, "pagoda-collide", "1.0", {"schedulers": "collide_sched"},
                      {"collide_sched": scheduler_module("EarliestDeadline", "edf")})
    return site


def test_an_entry_point_named_like_a_builtin_is_blocked_by_its_distribution_qualified_name(collide, monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "schedulers")  # the built-in only
    pm = PluginManager().load()
    assert pm.blocked == {"schedulers": BUILTIN_DIST}
    assert pm.names("pagoda_schedulers") == ["edf"]
    with pytest.raises(ConfigError, match=r"unknown scheduler 'fcfs'.*blocks the plugins schedulers \(pagoda "
                                          r"\(built-in\)\).*if 'fcfs' is one of them, unblock its plugin"):
        pm.get("pagoda_schedulers", "fcfs", "scheduling_policy")
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "pagoda-collide:schedulers")  # the third-party one only
    pm = PluginManager().load()
    assert pm.blocked == {"pagoda-collide:schedulers": "pagoda-collide 1.0"}
    assert pm.names("pagoda_schedulers") == ["fair", "fcfs", "priority"]
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "schedulers,pagoda-collide:schedulers,fcfs")
    pm = PluginManager().load()
    assert pm.blocked == {"schedulers": BUILTIN_DIST, "pagoda-collide:schedulers": "pagoda-collide 1.0"}
    assert pm.unmatched_blocks == ["fcfs"]  # a component name, not a plugin name


def test_disabling_one_of_two_duplicates_resolves_the_clash(site, monkeypatch):
    install_fake_dist(site, "shadow", "1.0", {"shadow": "shadow_sched"},
                      {"shadow_sched": scheduler_module("ShadowScheduler", "fcfs")})
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "shadow")
    assert PluginManager().load().get("pagoda_schedulers", "fcfs", "scheduling_policy").dist == BUILTIN_DIST


def test_autoload_zero_loads_builtins_only(acme, monkeypatch):
    monkeypatch.setenv("PAGODA_PLUGIN_AUTOLOAD", "0")
    pm = PluginManager().load()
    assert "acme-lottery" not in pm.names("pagoda_schedulers")
    assert "fcfs" in pm.names("pagoda_schedulers")


# ---- broken plugins ------------------------------------------------------------------------------


@pytest.fixture
def broken(site):
    install_fake_dist(site, "broken-plugin", "0.0.1", {"broken": "broken_plugin"},
                      {"broken_plugin": "import pagoda\nraise ImportError('needs libfrobnicate 2.0')\n"})
    return site


def test_a_plugin_that_fails_to_import_is_recorded_with_its_traceback(broken):
    pm = PluginManager().load()  # does not raise: nothing selected it yet
    [failure] = pm.failures
    assert failure.name == "broken" and failure.dist == "broken-plugin 0.0.1"
    assert "Traceback" in failure.error and "needs libfrobnicate 2.0" in failure.error
    assert "fcfs" in pm.names("pagoda_schedulers")


LAZY_BROKEN = """
import pagoda

@pagoda.hookimpl
def pagoda_schedulers():
    from frobnicate_sched import Scheduler  # a dependency that is not installed
    return {"frob": Scheduler}

@pagoda.hookimpl
def pagoda_samplers():
    from pagoda.sampling.sampler import Sampler
    return {"lazy-default": Sampler}
"""


def test_a_hook_that_fails_when_called_is_recorded_and_its_other_hooks_still_count(site):
    install_fake_dist(site, "lazy-plugin", "2.0", {"lazy": "lazy_plugin"}, {"lazy_plugin": LAZY_BROKEN})
    pm = PluginManager().load()
    [failure] = pm.failures
    assert (failure.name, failure.dist) == ("lazy", "lazy-plugin 2.0")
    assert "No module named 'frobnicate_sched'" in failure.error
    assert "fcfs" in pm.names("pagoda_schedulers") and "frob" not in pm.names("pagoda_schedulers")
    assert pm.get("pagoda_samplers", "lazy-default", "sampler").dist == "lazy-plugin 2.0"
    pm.register(FinishedRecorder(), name="recorder")  # rebuilding the registry does not repeat the failure
    assert len(pm.failures) == 1


def test_a_broken_plugin_only_stops_the_engine_when_a_missing_component_is_selected(broken, tiny_dir):
    llm = tiny_llm(tiny_dir)
    out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ConfigError) as info:
        tiny_llm(tiny_dir, scheduling_policy="frobnicate")
    msg = str(info.value)
    assert "plugins that failed to load: broken (broken-plugin 0.0.1: ImportError: needs libfrobnicate 2.0)" in msg
    assert "pagoda plugins" in msg


def test_pagoda_plugins_prints_the_broken_plugin_traceback_and_still_lists_the_rest(broken, capsys):
    result = run_pagoda_here(capsys, "plugins")  # read at each load: this process's plugin manager is as fresh
    assert result.returncode == 0
    assert "plugin 'broken' from broken-plugin 0.0.1 failed to load" in result.stderr
    assert "Traceback" in result.stderr and "needs libfrobnicate 2.0" in result.stderr
    assert any(line.split()[:2] == ["scheduler", "fcfs"] for line in result.stdout.splitlines())


# ---- run-time registration and observers ------------------------------------------------------


class FinishedRecorder:
    """An observer plugin: records every request the engine reports finished."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, str]] = []

    @hookimpl
    def pagoda_request_finished(self, request):
        self.finished.append((request.request_id, request.finish_reason))


def test_a_plugin_object_registered_at_run_time_observes_finished_requests(site, tiny_dir):
    pm = PluginManager().load()
    recorder = FinishedRecorder()
    pm.register(recorder, name="recorder", dist="test")
    llm = tiny_llm(tiny_dir, plugin_manager=pm)
    llm.generate(["a", "b c"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert sorted(recorder.finished) == [("llm-0", "length"), ("llm-1", "length")]


def test_a_component_registered_at_run_time_is_selectable(site, tiny_dir):
    from pagoda.sampling.sampler import Sampler

    class CountingSampler(Sampler):
        calls = 0

        def __call__(self, logits, requests):
            type(self).calls += 1
            return super().__call__(logits, requests)

    class Plugin:
        @hookimpl
        def pagoda_samplers(self):
            return {"counting": CountingSampler}

    pm = PluginManager().load()
    pm.register(Plugin(), name="counting-plugin", dist="test")
    assert pm.get("pagoda_samplers", "counting", "sampler").dist == "test"
    llm = tiny_llm(tiny_dir, plugin_manager=pm, sampler="counting")
    llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert CountingSampler.calls == 4


# ---- attention backends chosen by auto ---------------------------------------------------------

RANKED_BACKENDS = """
import pagoda
from pagoda.errors import BackendUnavailable
from pagoda.plugins.attention.torch_backend import TorchAttentionBackend


class FastBackend(TorchAttentionBackend):
    name = "acme-fast"
    auto_priority = {"cpu": 100}


class MissingBackend(TorchAttentionBackend):
    name = "acme-missing"
    auto_priority = {"cpu": 200}

    def __init__(self, model_config, cache_config):
        raise BackendUnavailable("needs the acme accelerator")


@pagoda.hookimpl
def pagoda_attention_backends():
    return {"acme-fast": FastBackend, "acme-missing": MissingBackend}
"""


def test_auto_picks_the_highest_ranked_backend_that_can_run_even_a_third_party_one(site, tiny_dir):
    from pagoda.execution.build import auto_backend_order

    install_fake_dist(site, "acme-attn", "1.0", {"acme_attn": "acme_attn"}, {"acme_attn": RANKED_BACKENDS})
    pm = PluginManager().load()
    assert [c.name for c in auto_backend_order(pm, "cpu")] == ["acme-missing", "acme-fast", "cpu", "torch"]
    assert [c.name for c in auto_backend_order(pm, "cuda")] == ["cuda", "triton", "torch"]
    llm = tiny_llm(tiny_dir, attention_backend="auto", plugin_manager=pm)
    assert type(llm.engine.backend).__name__ == "FastBackend"  # the unavailable one was skipped


# ---- no plugin problem stops `pagoda --help` or `pagoda plugins` -------------------------------------

TROUBLE = {
    "dup_a": scheduler_module("DupA", "lottery"),
    "dup_b": scheduler_module("DupB", "lottery"),
    "raising_hook": "import pagoda\n\n@pagoda.hookimpl\ndef pagoda_samplers():\n    raise RuntimeError('blew up')\n",
    "not_a_mapping": "import pagoda\n\n@pagoda.hookimpl\ndef pagoda_samplers():\n    return ['oops']\n",
    "import_error": "raise ImportError('needs libfrobnicate 2.0')\n",
    "wrong_api": scheduler_module("Future", "future") + "\nPAGODA_PLUGIN_API = '>=2,<3'\n",
    "cli_clash": """
        import pagoda

        def register(sub):
            sub.add_parser("plugins", help="a third-party 'plugins' command")

        @pagoda.hookimpl
        def pagoda_cli_commands():
            return {"plugins": register, "count-tokens": register}
    """,
    "cli_clash_2": """
        import pagoda

        def register(sub):
            sub.add_parser("count-tokens")

        @pagoda.hookimpl
        def pagoda_cli_commands():
            return {"count-tokens": register}
    """,
    # a package with its own `generate` command and `fcfs` policy: pagoda's keep their names
    "cli_generate": scheduler_module("MyFCFS", "fcfs") + """

def register(sub):
    parser = sub.add_parser("generate", help="the package's own generate")
    parser.set_defaults(func=lambda ns: print("the package's generate") or 0)

@pagoda.hookimpl
def pagoda_cli_commands():
    return {"generate": register}
""",
}


@pytest.fixture
def trouble(site):
    for module, source in TROUBLE.items():
        dist = "trouble-" + module.replace("_", "-")
        install_fake_dist(site, dist, "0.1", {module: module}, {module: source})
    return site


def test_help_and_plugins_run_whatever_the_installed_plugins_do(trouble, capsys):
    """Duplicate names (components and CLI commands), a hook that raises, one returning a list, an import
    error and an API range that excludes this pagoda: `--help` and `plugins` still work and show them.
    The commands by the console script's entry point in this process, whose plugin manager each loads afresh
    (test_cli.py runs the console script)."""
    help_run = run_pagoda_here(capsys, "--help")
    assert help_run.returncode == 0 and "Traceback" not in help_run.stderr, help_run.stderr
    assert "generate" in help_run.stdout and "plugins" in help_run.stdout
    assert "trouble-cli-generate:generate" in help_run.stdout  # the package's command, by its qualified name
    assert "(failed) import_error from trouble-import-error 0.1: ImportError: needs libfrobnicate 2.0" in help_run.stdout
    listing = run_pagoda_here(capsys, "plugins")
    assert listing.returncode == 0, listing.stderr
    out = listing.stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["scheduler", "trouble-dup-a:lottery", "dup_a", "trouble-dup-a", "0.1", "CONFLICT", "(see", "below)"] in rows
    assert ["scheduler", "trouble-dup-b:lottery", "dup_b", "trouble-dup-b", "0.1", "CONFLICT", "(see", "below)"] in rows
    assert ("conflict: two plugins provide the scheduler 'lottery': plugin 'dup_a' from trouble-dup-a 0.1 and "
            "plugin 'dup_b' from trouble-dup-b 0.1; select one by its qualified name 'trouble-dup-a:lottery' or "
            "'trouble-dup-b:lottery', uninstall one, or block one with PAGODA_DISABLE_PLUGINS=dup_b") in out
    assert ("conflict: two plugins provide the scheduler 'fcfs': plugin 'schedulers' from pagoda (built-in) and "
            "plugin 'cli_generate' from trouble-cli-generate 0.1; 'fcfs' selects pagoda's own, select the other by "
            "its qualified name 'trouble-cli-generate:fcfs'") in out
    assert "conflict: two plugins provide the CLI command 'plugins'" in out
    failed = {row[2] for row in rows if row and row[0] == "(failed)"}
    # cli_clash's register adds a `plugins` command whatever it is asked for: as 'trouble-cli-clash:count-tokens'
    # it clashes with pagoda's own `plugins`, which argparse refuses
    assert failed == {"raising_hook", "not_a_mapping", "import_error", "wrong_api", "cli_clash"}
    assert "conflicting subparser: plugins" in out
    assert "returned list ['oops'], not a {name: factory} mapping" in out
    assert ["scheduler", "fcfs", "schedulers", "pagoda", "(built-in)", "-"] in rows  # the rest is intact
    clash = run_pagoda_here(capsys, "count-tokens", "x")
    assert clash.returncode == 2 and "Traceback" not in clash.stderr
    lines = clash.stderr.strip().splitlines()
    assert lines[-1] == (
        "pagoda count-tokens: error: two plugins provide the CLI command 'count-tokens': plugin 'cli_clash' from "
        "trouble-cli-clash 0.1 and plugin 'cli_clash_2' from trouble-cli-clash-2 0.1; select one by its qualified "
        "name 'trouble-cli-clash:count-tokens' or 'trouble-cli-clash-2:count-tokens', uninstall one, or block one "
        "with PAGODA_DISABLE_PLUGINS=cli_clash_2")
    # every command says who clashes and how to choose
    assert ("pagoda: note: two plugins provide the CLI command 'generate': plugin 'entrypoints' from pagoda "
            "(built-in) and plugin 'cli_generate' from trouble-cli-generate 0.1; 'generate' selects pagoda's own, "
            "select the other by its qualified name 'trouble-cli-generate:generate'") in lines
    generate = run_pagoda_here(capsys, "generate", "--help")  # pagoda's own, with its engine options
    assert generate.returncode == 0 and "--scheduling-policy" in generate.stdout, generate.stderr
    theirs = run_pagoda_here(capsys, "trouble-cli-generate:generate")
    assert theirs.returncode == 0 and theirs.stdout.strip() == "the package's generate", theirs.stderr


def test_pagoda_plugins_shows_every_blocked_plugin_and_a_block_that_matches_none(collide, monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "schedulers,pagoda-collide:schedulers,fcfs")
    result = run_pagoda_here(capsys, "plugins")  # read at each load: this process's plugin manager is as fresh
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["(blocked)", "-", "schedulers", "pagoda", "(built-in)", "PAGODA_DISABLE_PLUGINS"] in rows
    assert ["(blocked)", "-", "pagoda-collide:schedulers", "pagoda-collide", "1.0", "PAGODA_DISABLE_PLUGINS"] in rows
    assert "PAGODA_DISABLE_PLUGINS names 'fcfs', which is no installed plugin" in result.stdout


# ---- composition: a component built on another one ---------------------------------------------------

WRAPPER = """
import pagoda

@pagoda.hookimpl
def pagoda_schedulers(plugin_manager):
    def counted(scheduler):
        inner = plugin_manager.factory("pagoda_schedulers", "priority")
        policy = inner(scheduler)
        policy.built_by = "counted"
        return policy
    return {"counted-priority": counted}
"""

EAGER = """
import pagoda

@pagoda.hookimpl
def pagoda_schedulers(plugin_manager):
    return {"eager": plugin_manager.factory("pagoda_schedulers", "fcfs")}
"""


def test_a_hook_taking_the_plugin_manager_wraps_a_builtin_by_kind_and_name(site, tiny_dir):
    install_fake_dist(site, "wrapper", "1.0", {"wrapper": "wrapper_sched"}, {"wrapper_sched": WRAPPER})
    pm = PluginManager().load()
    assert not pm.failures
    from pagoda.plugins.schedulers.priority import PriorityPolicy

    assert pm.factory("pagoda_schedulers", "priority") is PriorityPolicy
    llm = tiny_llm(tiny_dir, scheduling_policy="counted-priority")
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, PriorityPolicy) and policy.built_by == "counted"
    with pytest.raises(ConfigError, match=r"unknown scheduler 'nope' for plugin_manager.factory\('pagoda_schedulers', "
                                          r"'nope'\); available: 'counted-priority' \(wrapper 1.0\), 'fair'"):
        pm.factory("pagoda_schedulers", "nope")
    with pytest.raises(ConfigError, match="'attention backends' is not a component hook; use one of pagoda_model"):
        pm.factory("attention backends", "torch")


def test_looking_up_a_factory_while_components_are_collected_says_to_do_it_inside_the_factory(site):
    install_fake_dist(site, "eager", "1.0", {"eager": "eager_sched"}, {"eager_sched": EAGER})
    pm = PluginManager().load()
    [failure] = pm.failures
    assert "still being collected; call it inside your factory" in failure.reason
    assert "fcfs" in pm.names("pagoda_schedulers")
