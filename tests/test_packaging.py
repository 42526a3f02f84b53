"""The wheel: every module under core/ and plugins/ ships, under pagoda/ and pagoda/plugins/.

setuptools needs each package listed in pyproject.toml; a forgotten folder would install a
pagoda that fails on import elsewhere. The wheel is built from a copy of the sources so the
build never writes into the working tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "core", "plugins")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy(path, src / name)
    out = work / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "--wheel-dir", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = out.glob("pagoda-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def expected_modules() -> set[str]:
    """Wheel paths of every Python module in the source tree."""
    expected = set()
    for folder, package in (("core", "pagoda"), ("plugins", "pagoda/plugins")):
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            expected.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return expected


def test_every_module_under_core_and_plugins_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    expected = expected_modules()
    assert "pagoda/__init__.py" in expected and "pagoda/plugins/schedulers/fair.py" in expected
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"


def test_every_source_folder_with_modules_is_a_package(wheel):
    # a folder of modules without __init__.py is skipped by an explicit package list
    for folder in ("core", "plugins"):
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert (path.parent / "__init__.py").exists(), f"{path.parent} has no __init__.py"


def test_the_wheel_declares_the_console_script_and_the_builtin_entry_points(wheel):
    [entry_points] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[console_scripts]" in text and "pagoda = pagoda.cli:main" in text
    assert "[pagoda.plugins]" in text
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    for name, module in pyproject["project"]["entry-points"]["pagoda.plugins"].items():
        assert f"{name} = {module}" in text


def test_the_wheel_holds_no_tests_or_contrib_packages(wheel):
    top_level = {n.split("/", 1)[0] for n in wheel.namelist()}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"pagoda"}


def test_the_kernel_sources_compiled_on_first_use_and_the_chat_templates_are_in_the_wheel(wheel):
    names = set(wheel.namelist())
    sources = []
    for tree, package in ((REPO / "core", "pagoda"), (REPO / "plugins", "pagoda/plugins")):
        for path in tree.rglob("*"):
            if path.suffix in (".cpp", ".cu", ".h", ".jinja"):  # and the chat templates read at start-up
                sources.append(f"{package}/{path.relative_to(tree).as_posix()}")
    assert any(s.startswith("pagoda/plugins/attention/") for s in sources)
    assert "pagoda/modeling/layers/cpu_ops.cpp" in sources
    assert sorted(s for s in sources if s not in names) == []
