"""The README's promises: its Python example runs, and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_example_runs(capsys) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no Python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["hits"] == 3
    assert "BlockStored" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^(bash \.ci/setup && .+)$", readme, flags=re.M)
    assert len(commands) == 2, commands
    replay_cmd, test_cmd = commands
    assert "kvoff replay" in replay_cmd
    assert "pytest" in test_cmd
    assert test_cmd in ci.splitlines()
