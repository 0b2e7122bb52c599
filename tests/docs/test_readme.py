"""The README's promises: its Python example runs, and CI runs its test command."""

from __future__ import annotations

import ast
import json
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


def test_readme_is_a_short_guide_that_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is a guide: details go to docs/"
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first_block, "README.md has no bash block"
    assert re.findall(r"^bash \.ci/setup && .+$", first_block.group(1), flags=re.M) == re.findall(
        r"^(bash \.ci/setup && .+)$", readme, flags=re.M
    ), "the first code block of README.md is the two commands"
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections[0] == "The two commands", sections


def test_readme_names_the_quick_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = re.findall(r"^(python3 -m pytest -n \d+ -m .+)$", readme, flags=re.M)
    assert len(quick) == 1, quick
    markers = set(re.findall(r"not (\w+)", quick[0]))
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for marker in markers:  # every marker it leaves out is declared
        assert f'"{marker}: ' in pyproject, marker
    assert '"build": "build"' in conftest and '"integrations": "vllm"' in conftest


def _serve_configs(text: str) -> list[dict]:
    return [
        json.loads(m)
        for m in re.findall(r"vllm serve \S+ --kv-transfer-config '(\{.*?\})'", text, flags=re.S)
    ]


def test_readme_vllm_serve_lines_are_the_tested_configurations() -> None:
    """The README's two ``vllm serve`` lines are the two configurations
    tests/integrations/test_vllm_serve.py starts a server with (but for the pool's size)."""
    source = (ROOT / "tests" / "integrations" / "test_vllm_serve.py").read_text()
    node = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "CONNECTORS"
    )
    tested = ast.literal_eval(node.value)
    shown = _serve_configs((ROOT / "README.md").read_text())
    assert len(shown) == 2, shown

    def without_size(config: dict) -> dict:
        extra = dict(config["kv_connector_extra_config"])
        assert "cpu_bytes_to_use" in extra
        extra.pop("cpu_bytes_to_use")
        return {**config, "kv_connector_extra_config": extra}

    assert [without_size(c) for c in shown] == [
        without_size(tested["kvoff"]),
        without_size(tested["spec"]),
    ]
