"""The offline examples of the README and docs/structured_outputs.md, run as a user runs them: copied verbatim into
a script file (no ``if __name__ == "__main__":``) and run with this Python, on the default model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


def run_script(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_the_readme_s_offline_example_runs_as_a_script(tmp_path):
    (code,) = [b for b in python_blocks(ROOT / "README.md") if "LLM(" in b]
    run = run_script(tmp_path, code)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    # two prompts, each line ending with its finish reason, then the chat answer
    assert sum(line.endswith((" length", " stop")) for line in lines) >= 2 and len(lines) >= 3, run.stdout


def test_the_structured_outputs_example_runs_as_a_script_and_prints_its_json(tmp_path):
    (code,) = [b for b in python_blocks(ROOT / "docs" / "structured_outputs.md") if "LLM(" in b]
    run = run_script(tmp_path, code)
    assert run.returncode == 0, run.stderr[-3000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
