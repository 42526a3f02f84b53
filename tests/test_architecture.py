"""The import rules between pagoda's packages (docs/architecture.md), checked on the source tree.

Every ``import`` of a pagoda module in ``core/`` and ``plugins/`` is an edge from the importing package to
the imported one, function-level imports included (they run too); imports under ``if TYPE_CHECKING:`` are
for annotations only and are not counted. An edge that ALLOWED does not list fails with the file, the line
and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagoda

REPO = Path(__file__).resolve().parent.parent
TREES = ((REPO / "core", "pagoda"), (REPO / "plugins", "pagoda.plugins"))

CORE_PACKAGES = ("engine", "registry", "kv", "execution", "modeling", "sampling", "host", "testing", "scheduling")
ENTRYPOINT_PACKAGES = ("bench", "cli", "server", "simulate", "replicas", "tool_parsers", "reasoning_parsers")
# the modules at the top of pagoda: the public API (users' and plugins'), all importing only each other
# and the host layer; the base (pagoda itself: its version, hookimpl and errors) imports nothing else of pagoda's
BASE = {"errors"}
TOP = BASE | {"config", "hookspecs", "interfaces", "sequence", "sampling_params", "step", "outputs",
              "tool_calls", "reasoning"}

# unit -> the units it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "base": set(),  # pagoda/__init__.py too: the other public names are loaded on first use
    "top": {"base", "host"},
    "host": {"base"},
    "registry": {"base", "top", "host"},
    "kv": {"base", "top", "host", "registry"},
    "scheduling": {"base", "top", "kv"},
    "sampling": {"base", "top", "host", "registry"},
    "execution": {"base", "top", "host", "registry", "kv", "sampling"},
    "modeling": {"base", "top", "host", "registry", "execution"},
    "engine": {"base", "top", "host", "registry", "kv", "sampling", "execution", "modeling", "scheduling"},
    "cli": {"base", "top", "host", "registry", "engine"},
    "testing": {"base", "top", "host", "registry", "kv", "sampling", "execution", "modeling", "engine",
                "scheduling"},
}
CORE_UNITS = set(ALLOWED) - {"testing"}
PLUGIN_KINDS = ("schedulers", "attention", "quant", "spec_decode", "kv_connectors", "entrypoints")
for kind in PLUGIN_KINDS:  # a plugin uses core (not the conformance kit) and no other plugin kind
    ALLOWED[f"plugins.{kind}"] = set(CORE_UNITS)
ALLOWED["plugins"] = {"base"}  # the plugins package itself
# the benchmarks report what the built-in kernels did: the Triton backend's CPU caveat, the quantized
# kernels' ISA paths and weight memory
EXCEPTIONS = {("plugins.entrypoints", "plugins.attention"), ("plugins.entrypoints", "plugins.quant")}


def unit_of(module: str) -> str:
    """The package a pagoda module belongs to for the rules: a core package, a plugin kind, or the top."""
    parts = module.split(".")
    if parts[:2] == ["pagoda", "plugins"]:
        return "plugins" if len(parts) == 2 else f"plugins.{parts[2]}"
    if len(parts) == 1:
        return "base"
    if parts[1] in CORE_PACKAGES:
        return parts[1]
    if parts[1] == "cli":
        return "cli"
    return "base" if parts[1] in BASE else "top"


def module_name(path: Path, root: Path, package: str) -> str:
    rel = path.relative_to(root).with_suffix("").parts
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join((package, *rel))


def imported_modules(source: str, importer: str) -> list[tuple[int, str]]:
    """(line, module) of every pagoda import in ``source`` outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "pagoda"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "pagoda":
            # "from pagoda.host import openmp" imports a module; "from pagoda import hookimpl" a name, from
            # the module that defines it
            found += [(node.lineno, _defining_module(node.module, a.name)) for a in node.names]
    return sorted(set(found))


def _defining_module(module: str, name: str) -> str:
    if module == "pagoda":
        return pagoda._LAZY.get(name) or PACKAGE_NAMES.get(name) or f"pagoda.{name}"
    return f"{module}.{name}" if _is_package(module) else module


# names the pagoda package itself defines or re-exports from its base modules
PACKAGE_NAMES = {name: "pagoda.errors" for name in ("PagodaError", "ConfigError", "InvalidRequestError",
                                                    "CheckpointError", "BackendUnavailable")}
PACKAGE_NAMES.update(hookimpl="pagoda", __version__="pagoda", PLUGIN_API_VERSION="pagoda")


def _is_package(module: str) -> bool:
    for root, package in TREES:
        if module == package or module.startswith(package + "."):
            rel = module[len(package):].lstrip(".").replace(".", "/")
            return (root / rel / "__init__.py").exists() and module != "pagoda"
    return False


def violations(source: str, importer: str, where: str) -> list[str]:
    """Every import of ``source`` (module ``importer``) that the rules forbid, as messages."""
    own = unit_of(importer)
    found = []
    for line, module in imported_modules(source, importer):
        other = unit_of(module)
        if other == own or other in ALLOWED[own] or (own.startswith("plugins.entrypoints")
                                                    and (own, other) in EXCEPTIONS):
            continue
        if own in CORE_UNITS | {"testing"} and other.startswith("plugins"):
            rule = "core never imports a plugin (the engine reaches plugins through the hooks)"
        elif own.startswith("plugins.") and other.startswith("plugins."):
            rule = "a plugin kind does not import another (it asks the plugin manager for a component by name)"
        else:
            rule = f"{own} may import only {', '.join(sorted(ALLOWED[own])) or 'no other package'}"
        found.append(f"{where}:{line}: {importer} imports {module} ({own} -> {other}): {rule}")
    return found


def source_files():
    for root, package in TREES:
        for path in sorted(root.rglob("*.py")):
            yield path, module_name(path, root, package)


def test_every_package_imports_only_what_the_rules_allow():
    found = []
    for path, module in source_files():
        found += violations(path.read_text(), module, str(path.relative_to(REPO)))
    assert not found, "import rules broken (docs/architecture.md):\n" + "\n".join(found)


@pytest.mark.parametrize("importer,source,broken", [
    ("pagoda.engine.llm_engine", "from pagoda.plugins.entrypoints.server import routes\n",
     "core never imports a plugin"),
    ("pagoda.kv.blocks", "def f():\n    from pagoda.engine.llm_engine import LLMEngine\n", "kv may import only"),
    ("pagoda.plugins.schedulers.fair", "from pagoda.plugins.quant import base\n",
     "a plugin kind does not import another"),
    ("pagoda.host.threads", "from pagoda.config import EngineConfig\n", "host may import only base"),
])
def test_a_forbidden_import_is_reported_with_the_rule_it_breaks(importer, source, broken):
    found = violations(source, importer, "x.py")
    assert len(found) == 1 and broken in found[0], found


def test_type_checking_imports_are_not_edges():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagoda.engine.llm import LLM\n"
    assert violations(source, "pagoda.kv.blocks", "x.py") == []


def test_every_core_package_and_plugin_kind_has_a_rule():
    for path, module in source_files():
        assert unit_of(module) in ALLOWED, module
    packages = {p.name for p in (REPO / "core").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(CORE_PACKAGES), "a new core package needs its row in ALLOWED and docs/architecture.md"


def test_the_top_of_pagoda_is_the_public_api_and_the_command():
    # a module used by one package lives in it; the top keeps what users and plugins import (and the CLI)
    top = {p.stem for p in (REPO / "core").glob("*.py")} - {"__init__"}
    assert top == TOP | {"cli"}, "a new top-level module needs its place in TOP and docs/architecture.md"
    assert len(top) + 1 <= 12, f"core/ keeps {len(top) + 1} top-level modules; move one into the package using it"


def test_the_built_in_entry_points_are_the_table_in_the_architecture_page():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["pagoda.plugins"]
    page = (REPO / "docs" / "architecture.md").read_text()
    section = page[page.index("## Where the built-in components live"):page.index("The modules at the top of")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0]] = cells[1]
    assert rows == declared
    # a built-in registered from core is a core package's module; the others are the plugin kinds
    for name, module in declared.items():
        parts = module.split(".")
        assert parts[1] in CORE_PACKAGES or (parts[1] == "plugins" and parts[2] in PLUGIN_KINDS), (name, module)
