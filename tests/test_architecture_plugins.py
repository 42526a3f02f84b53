"""Third-party architectures: a distribution installed with a ``pagoda.plugins`` entry point (a dist-info
directory on sys.path, what pip would leave) that registers an architecture under a built-in's name overrides the
built-in, and ``pagoda plugins`` says which one is used; two third-party providers of one name still clash. The
conformance kit's ``check_architecture`` passes such an architecture against transformers and catches a broken
one."""

from __future__ import annotations

import importlib
import sys

import pytest

from pagoda import hookimpl
from pagoda.errors import ConfigError
from pagoda.registry.plugin_manager import BUILTIN_DIST, PluginManager
from pagoda.testing import ContractError, check_architecture
from serve_process import run_pagoda_here

HOOK = "pagoda_model_architectures"
PLUGIN_SOURCE = '''
import pagoda
from pagoda.modeling.models.qwen3 import Qwen3ForCausalLM

PAGODA_PLUGIN_API = ">=0.10,<0.11"


class FasterQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3 as a third party ships it (here: pagoda's, counting its forward calls)."""

    def forward(self, *args, **kwargs):
        self.num_forward_calls = getattr(self, "num_forward_calls", 0) + 1
        return super().forward(*args, **kwargs)


@pagoda.hookimpl
def pagoda_model_architectures():
    return {"Qwen3ForCausalLM": FasterQwen3ForCausalLM}
'''
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 256, "initializer_range": 0.2, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The distribution ``faster-qwen3 1.0``, installed on sys.path; yields its folder."""
    site = tmp_path_factory.mktemp("arch-site")
    (site / "faster_qwen3.py").write_text(PLUGIN_SOURCE)
    dist = site / "faster_qwen3-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: faster-qwen3\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pagoda.plugins]\nfaster_qwen3 = faster_qwen3\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("faster_qwen3", None)
        importlib.invalidate_caches()


def test_an_installed_architecture_overrides_the_built_in_of_its_name(site):
    from pagoda.modeling.models.qwen3 import Qwen3ForCausalLM

    pm = PluginManager().load()
    used = pm.get(HOOK, "Qwen3ForCausalLM", "test")
    assert used.factory.__name__ == "FasterQwen3ForCausalLM" and used.dist == "faster-qwen3 1.0"
    assert issubclass(used.factory, Qwen3ForCausalLM) and used.factory is not Qwen3ForCausalLM
    [(override, builtin)] = pm.override_list()
    assert override is used and builtin.dist == BUILTIN_DIST and builtin.factory is Qwen3ForCausalLM
    assert not pm.conflict_list()
    # the other built-ins are untouched; blocking the plugin brings the built-in back
    assert pm.get(HOOK, "Qwen3MoeForCausalLM", "test").dist == BUILTIN_DIST
    blocked = PluginManager().load(disabled={"faster_qwen3"})
    assert blocked.get(HOOK, "Qwen3ForCausalLM", "test").factory is Qwen3ForCausalLM


def test_pagoda_plugins_shows_which_architecture_is_used_and_from_where(site, capsys, monkeypatch):
    # the command's entry point in this process, whose plugin manager it loads afresh (test_cli.py runs the
    # console script)
    monkeypatch.delenv("PAGODA_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGODA_PLUGIN_AUTOLOAD", raising=False)
    result = run_pagoda_here(capsys, "plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = [line.split() for line in out.splitlines()
            if {"Qwen3ForCausalLM", "pagoda:Qwen3ForCausalLM"} & set(line.split())]
    assert ["model", "architecture", "Qwen3ForCausalLM", "faster_qwen3", "faster-qwen3", "1.0", ">=0.10,<0.11"] in rows
    # the built-in, under the qualified name that still selects it
    assert any(row[2] == "pagoda:Qwen3ForCausalLM" and row[-3:] == ["OVERRIDDEN", "by", "'faster_qwen3'"]
               for row in rows)
    assert ("override: the model architecture 'Qwen3ForCausalLM' is plugin 'faster_qwen3' from faster-qwen3 1.0, "
            "used instead of pagoda (built-in)'s") in out


def test_two_third_party_architectures_of_one_name_clash(site):
    class Another:
        @hookimpl
        def pagoda_model_architectures(self):
            from pagoda.modeling.models.qwen3 import Qwen3ForCausalLM
            return {"Qwen3ForCausalLM": Qwen3ForCausalLM}

    pm = PluginManager().load()
    pm.register(Another(), name="another-qwen3", dist="another 2.0")
    with pytest.raises(ConfigError, match="plugins provide the model architecture 'Qwen3ForCausalLM'") as caught:
        pm.get(HOOK, "Qwen3ForCausalLM", "the checkpoint's architectures")
    assert "faster-qwen3 1.0" in str(caught.value) and "another 2.0" in str(caught.value)
    assert not pm.override_list()


def test_check_architecture_passes_the_third_party_qwen3_against_transformers(site):
    """Also: the engine runs the plugin's class, not the built-in."""
    factory = PluginManager().load().get(HOOK, "Qwen3ForCausalLM", "test").factory
    check_architecture(factory, QWEN3)


def test_check_architecture_catches_a_wrong_forward():
    from pagoda.modeling.models.qwen3 import Qwen3ForCausalLM

    class NoQKNormQwen3(Qwen3ForCausalLM):  # forgets the q/k norms
        @classmethod
        def spec_from_hf(cls, cfg):
            import dataclasses
            return dataclasses.replace(super().spec_from_hf(cfg), qk_norm=None)

        def load_weights(self, weights):
            super().load_weights((n, t) for n, t in weights if "_norm" not in n or "layernorm" in n)

    with pytest.raises(ContractError, match="greedy tokens equal transformers'"):
        check_architecture(NoQKNormQwen3, QWEN3, backends=("torch",))


def test_check_architecture_runs_an_architecture_transformers_does_not_know():
    """A new name over a model_type transformers knows: loaded, finite, consistent over batches, the prefix cache
    and backends (no reference to compare with)."""
    from pagoda.modeling.models.llama import LlamaForCausalLM

    class ScaledLlamaForCausalLM(LlamaForCausalLM):
        def compute_logits(self, hidden):
            return super().compute_logits(hidden) * 0.5

    config = dict(QWEN3, architectures=["ScaledLlamaForCausalLM"], model_type="llama", head_dim=16)
    check_architecture(ScaledLlamaForCausalLM, config)
