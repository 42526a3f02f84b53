"""Deprecated names in a running engine: a hook implemented under its old name, a component with a method
under its old name, and a sampler overriding the 1.0 name of one of its steps are used, with a warning.

No hook and no component method has been renamed yet, so those mechanisms are shown on renames the tests
add to pagoda.registry.deprecation's table (tests/test_deprecation.py covers the table itself).
"""

from __future__ import annotations

import sys
import warnings

import pluggy
import pytest

from pagoda import ConfigError, SamplingParams, hookimpl, hookspecs
from pagoda.registry import deprecation
from pagoda.registry.deprecation import HOOK, METHOD, Deprecation
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling.sampler import Sampler
from tiny_models import tiny_llm, write_tiny_checkpoint


def add_deprecation(monkeypatch, entry: Deprecation) -> None:
    monkeypatch.setattr(deprecation, "DEPRECATIONS", deprecation.DEPRECATIONS + (entry,))


# ---- hooks and component methods (renames the tests add to the table) ------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


class CountingSampler:
    """The default sampler, counting its calls."""

    def __init__(self, model_config) -> None:
        from pagoda.sampling.sampler import Sampler

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
        "from pagoda.sampling.sampler import Sampler\n\n"
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
    assert pm.hook.pagoda_samplers(plugin_manager=None) == []
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
        from pagoda.modeling.loader import DummyLoader

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

def test_a_1_0_sampler_overriding_a_private_step_removed_in_1_3_is_refused_with_its_replacement():
    """A sampler plugin as written for plugin API 1.0 overrode the then-private ``_apply_penalties``; the name
    was deprecated in 1.1 and removed in 1.3, so the class is refused when it is created instead of running
    without its override."""
    with pytest.raises(TypeError, match=r"overrides Sampler\._apply_penalties, which Sampler no longer calls "
                                        r"\(it was deprecated in pagoda plugin API 1\.1 and removed in 1\.3\): "
                                        r"override apply_penalties instead"):
        class FavouriteTokenSampler(Sampler):
            def _apply_penalties(self, logits, requests):
                logits[:, 7] += 1e4
