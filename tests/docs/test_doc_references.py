"""What the user docs (README.md, docs/*.md) name exists: every ``kvoff`` command, subcommand
and option in their code (checked against the real argparse parser), every configuration key in
their examples (``--kv-transfer-config`` JSON, Python ``kv_connector_extra_config`` dicts, YAML
files, ``KVOFF_*`` variables; checked against ``OffloadingConfig``), every ``bench/results/``
path they or the code cite, and every relative link and its anchor."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from docs_text import (
    ROOT,
    anchors,
    code_blocks,
    doc_files,
    inline_spans,
    kvoff_parser,
    options,
    rel,
    subcommands,
)

from kvoff import OffloadingConfig

FIELDS = frozenset(OffloadingConfig.model_fields)

#: ``kv_connector_extra_config`` keys that vLLM's OffloadingConnector reads itself (the spec path
#: passes them by), and vLLM's Python-policy key, which kvoff accepts only when empty.
VLLM_SPEC_KEYS = frozenset(
    {"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
     "self_describing_kv_events", "canonical_layout", "kv_load_tiers"}
)  # fmt: skip

#: ``KVOFF_*`` variables the docs may name that are not configuration keys, each with a file that
#: reads it (so a renamed variable fails here too).
OTHER_ENV = {
    "KVOFF_CONFIG_FILE": "kvoff/config.py",
    "KVOFF_TRANSFER_THRESHOLDS": "kvoff/transfer.py",
    "KVOFF_CACHE_DIR": "kvoff/calibration.py",
    "KVOFF_TORCH": ".ci/setup",
    "KVOFF_ENABLE_CUDA": "CMakeLists.txt",
    "KVOFF_CUDA_TORCH_PYTHON": "tests/build/test_cuda_build.py",
}

#: Tokens after which ``kvoff`` is a command being run (not a word of prose or a package name).
_COMMAND_START = {"&&", "||", "|", ";", "-m", "then", "do", "$", "timeout"}
_END = {"&&", "||", "|", ";", ">", "2>&1", "#"}


# ------------------------------------------------------------------------- kvoff commands


def _command_lines() -> Iterator[tuple[str, str]]:
    """(file, text) for every shell line of a code block and every inline code span."""
    for path in doc_files():
        for block in code_blocks(path):
            if block.lang in ("python", "yaml", "json"):
                continue
            for line in block.text.replace("\\\n", " ").splitlines():
                yield rel(path), line
        for span in inline_spans(path):
            yield rel(path), span


def _invocations(text: str) -> Iterator[list[str]]:
    """The argument lists after each ``kvoff`` run in ``text`` (up to ``&&``, ``|``, ``#``...)."""
    tokens = text.split()
    for i, token in enumerate(tokens):
        if token != "kvoff":
            continue
        before = tokens[i - 1] if i else None
        if before is not None and before not in _COMMAND_START and "=" not in before:
            continue  # "import kvoff", "install kvoff", prose
        args: list[str] = []
        for arg in tokens[i + 1 :]:
            if arg in _END or arg.startswith("#"):
                break
            args.append(arg)
        yield args


def _check_invocation(args: list[str]) -> str | None:
    """Why ``kvoff ARGS`` names something the parser does not have, or None."""
    parser = kvoff_parser()
    words: list[str] = []
    rest = list(args)
    while (subs := subcommands(parser)) and rest and not rest[0].startswith("-"):
        word = rest.pop(0)
        if word not in subs:
            return f"`kvoff {' '.join([*words, word])}`: no such command (have {sorted(subs)})"
        words.append(word)
        parser = subs[word]
    if subcommands(parser) and not words and not rest:
        return None  # `kvoff` alone, as a name
    known = options(parser)
    for arg in rest:
        if arg.startswith("--") and len(arg) > 2:
            name = arg.split("=", 1)[0]
            if name not in known:
                return f"`kvoff {' '.join(words)} {name}`: no such option (have {sorted(known)})"
    return None


def test_every_kvoff_command_and_option_in_the_docs_exists() -> None:
    problems: list[str] = []
    seen = 0
    for where, text in _command_lines():
        for args in _invocations(text):
            seen += 1
            why = _check_invocation(args)
            if why:
                problems.append(f"{where}: {why}")
    assert seen > 20, f"found only {seen} kvoff invocations: is the parsing broken?"
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_misspelt_name() -> None:
    """The check itself: a wrong command, subcommand or option is reported."""
    assert _check_invocation(["replay", "--cpu-bytes", "8GiB"]) is None
    assert _check_invocation(["bench", "scheduler", "--vs-vllm"]) is None
    assert _check_invocation(["replays"]) is not None
    assert _check_invocation(["bench", "schedule"]) is not None
    assert _check_invocation(["replay", "--cpu-byte", "8GiB"]) is not None
    assert list(_invocations("python -m kvoff replay --help && kvoff info")) == [
        ["replay", "--help"],
        ["info"],
    ]
    assert not list(_invocations("import kvoff")), "a Python import is not a command"


# ---------------------------------------------------------------------- configuration keys


def _transfer_configs() -> Iterator[tuple[str, dict]]:
    """Every ``--kv-transfer-config '{...}'`` of a code block, parsed (it must be JSON)."""
    for path in doc_files():
        for block in code_blocks(path):
            for m in re.finditer(r"--kv-transfer-config\s+'(\{.*?\})'", block.text, flags=re.S):
                try:
                    yield rel(path), json.loads(m.group(1))
                except json.JSONDecodeError as exc:
                    pytest.fail(f"{rel(path)}: --kv-transfer-config is not JSON: {exc}")


def _kvoff_keys(config: dict) -> dict:
    """The ``OffloadingConfig`` part of a transfer config's ``kv_connector_extra_config``."""
    extra = dict(config.get("kv_connector_extra_config", {}))
    if config["kv_connector"] == "OffloadingConnector":
        assert extra.get("spec_name") == "KvoffOffloadingSpec", config
        assert extra.get("spec_module_path") == "kvoff.integrations.vllm", config
        extra = {k: v for k, v in extra.items() if k not in VLLM_SPEC_KEYS}
    else:
        assert config["kv_connector"] == "KvoffConnector", config
        assert config["kv_connector_module_path"] == "kvoff.integrations.vllm", config
    return extra


def test_every_kv_transfer_config_in_the_docs_is_valid() -> None:
    configs = list(_transfer_configs())
    assert len(configs) >= 4, configs  # the README's two, docs/vllm.md's
    for where, config in configs:
        extra = _kvoff_keys(config)
        unknown = set(extra) - FIELDS
        assert not unknown, f"{where}: unknown kv_connector_extra_config keys {unknown}"
        OffloadingConfig.from_dict(extra)  # the values are valid too


def test_every_python_extra_config_and_yaml_file_in_the_docs_uses_real_keys() -> None:
    checked = 0
    for path in doc_files():
        for block in code_blocks(path):
            if block.lang == "python":
                for node in ast.walk(ast.parse(block.text)):
                    if (
                        isinstance(node, ast.keyword)
                        and node.arg == "kv_connector_extra_config"
                        and isinstance(node.value, ast.Dict)
                    ):
                        keys = {ast.literal_eval(k) for k in node.value.keys if k is not None}
                        assert keys <= FIELDS, f"{rel(path)}: unknown keys {keys - FIELDS}"
                        checked += 1
            elif block.lang in ("yaml", "yml"):
                data = yaml.safe_load(block.text)
                assert isinstance(data, dict), f"{rel(path)}: a YAML block that is not a mapping"
                assert set(data) <= FIELDS, f"{rel(path)}: unknown keys {set(data) - FIELDS}"
                OffloadingConfig.from_dict(data)
                checked += 1
    assert checked >= 2, checked


def test_every_kvoff_environment_variable_in_the_docs_exists() -> None:
    field_vars = {f"KVOFF_{f.upper()}" for f in FIELDS}
    problems: list[str] = []
    for path in doc_files():
        for name in sorted(set(re.findall(r"\bKVOFF_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))):
            if name in field_vars:
                continue
            reader = OTHER_ENV.get(name)
            if reader is None:
                problems.append(f"{rel(path)}: {name} is neither KVOFF_<key> nor a known variable")
            elif name not in (ROOT / reader).read_text():
                problems.append(f"{rel(path)}: {name} is no longer read by {reader}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ results and links

_RESULT = re.compile(r"(--json\s+)?(bench/results/[A-Za-z0-9_.*+/-]*)")


def _cited_results() -> Iterator[tuple[str, str]]:
    sources = [*doc_files()]
    for folder in ("kvoff", "cpp", "cuda"):
        sources += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file()]
    for path in sources:
        if path.suffix not in (".md", ".py", ".cpp", ".h", ".cu", ".cuh", ".txt", ".json"):
            continue
        for m in _RESULT.finditer(path.read_text(errors="replace")):
            if m.group(1):
                continue  # an output path of a command, not a citation
            yield rel(path), m.group(2).rstrip(".,;:")


def test_every_cited_measurement_exists() -> None:
    cited = list(_cited_results())
    assert len(cited) > 10, cited
    missing = [
        f"{where}: {target}"
        for where, target in cited
        if not (any(ROOT.glob(target)) if "*" in target else (ROOT / target).exists())
    ]
    assert not missing, "cited but not in bench/results:\n" + "\n".join(missing)


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    problems: list[str] = []
    for path in doc_files():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{rel(path)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(Path(dest)):
                problems.append(f"{rel(path)}: link to {target}: no such heading")
    assert not problems, "\n".join(problems)
