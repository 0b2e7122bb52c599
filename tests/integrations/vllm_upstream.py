"""Helpers of test_vllm_upstream.py (see its docstring): vLLM's sdist fetched and cached, three of
its test files extracted and adapted (construction lines only, as explicit replacements), run in
a subprocess with vllm_upstream_plugin.py, and their per-test outcomes read back."""

from __future__ import annotations

import ast
import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# From PyPI's simple index (https://pypi.org/simple/vllm/, Accept:
# application/vnd.pypi.simple.v1+json): the file vllm-0.32.0.tar.gz, its URL and sha256.
VLLM_VERSION = "0.32.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
SDIST_PREFIX = f"vllm-{VLLM_VERSION}/"  # the sdist's top folder

MANAGER = "tests/v1/kv_offload/cpu/test_manager.py"
FACTORY = "tests/v1/kv_offload/test_factory.py"
SCHEDULER = "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py"

_OFFLOADING_CONNECTOR = "tests/v1/kv_connector/unit/offloading_connector"


class DownloadError(Exception):
    """The sdist could not be downloaded (no network): the tests skip."""


class AdaptationError(AssertionError):
    """vLLM's text to replace was not found exactly once: the file is not the one the
    replacements were written for."""


@dataclass(frozen=True)
class Replacement:
    """``old`` must occur exactly once in the file; it becomes ``new``."""

    old: str
    new: str


@dataclass(frozen=True)
class UpstreamFile:
    """One of vLLM's test files, run against kvoff.

    Attributes:
        path: in vLLM's repository (and sdist).
        support: the files it imports or needs (``__init__.py``, ``conftest.py``, helpers).
        replacements: its adaptation (construction lines only).
        forbidden: text that must not remain after the adaptation (a vLLM construction).
        kvoff_markers: a test whose function contains one of these builds the manager or spec
            under test, so it must have constructed kvoff's.
    """

    path: str
    support: tuple[str, ...]
    replacements: tuple[Replacement, ...]
    forbidden: tuple[str, ...]
    kvoff_markers: tuple[str, ...]


_KVOFF_IMPORT = "from vllm_upstream_plugin import kvoff_cpu_manager  # kvoff\n"
_VLLM_MANAGER_IMPORT = "from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager\n"

UPSTREAM_FILES: dict[str, UpstreamFile] = {
    MANAGER: UpstreamFile(
        path=MANAGER,
        support=(
            "tests/__init__.py",
            "tests/v1/__init__.py",
            "tests/v1/kv_offload/__init__.py",
            "tests/v1/kv_offload/cpu/__init__.py",
        ),
        replacements=(
            Replacement(_VLLM_MANAGER_IMPORT, _VLLM_MANAGER_IMPORT + _KVOFF_IMPORT),
            Replacement(
                "    return CPUOffloadingManager(\n"
                "        num_chunks=num_chunks,\n"
                "        cache_policy=cache_policy,\n"
                "        cache_policy_module_path=cache_policy_module_path,\n"
                "        enable_events=enable_events,\n"
                "        store_threshold=store_threshold,\n"
                "        max_tracker_size=max_tracker_size,\n"
                "    )\n",
                "    return kvoff_cpu_manager(  # kvoff: kvoff's manager, the same arguments\n"
                "        num_chunks=num_chunks,\n"
                "        cache_policy=cache_policy,\n"
                "        cache_policy_module_path=cache_policy_module_path,\n"
                "        enable_events=enable_events,\n"
                "        store_threshold=store_threshold,\n"
                "        max_tracker_size=max_tracker_size,\n"
                "    )\n",
            ),
        ),
        forbidden=("CPUOffloadingManager(",),
        kvoff_markers=("make_cpu_manager(", "self._make_manager("),
    ),
    FACTORY: UpstreamFile(
        path=FACTORY,
        support=("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_offload/__init__.py"),
        replacements=(
            Replacement(
                "from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec\n"
                "from vllm.v1.kv_offload.factory import OffloadingSpecFactory\n",
                "from vllm.v1.kv_offload.factory import OffloadingSpecFactory\n"
                "from kvoff.integrations.vllm import KvoffOffloadingSpec as CPUOffloadingSpec"
                "  # kvoff\n"
                "\n"
                "# kvoff: the spec vLLM's factory builds for \"CPUOffloadingSpec\" is kvoff's\n"
                'OffloadingSpecFactory._registry["CPUOffloadingSpec"] = '
                "lambda: CPUOffloadingSpec\n",
            ),
        ),
        forbidden=("from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec",),
        kvoff_markers=("_create_spec(",),
    ),
    SCHEDULER: UpstreamFile(
        path=SCHEDULER,
        support=(
            "tests/__init__.py",
            "tests/v1/__init__.py",
            "tests/v1/kv_connector/__init__.py",
            "tests/v1/kv_connector/unit/__init__.py",
            "tests/v1/kv_connector/unit/conftest.py",
            "tests/v1/kv_connector/unit/utils.py",
            f"{_OFFLOADING_CONNECTOR}/__init__.py",
            f"{_OFFLOADING_CONNECTOR}/conftest.py",
            f"{_OFFLOADING_CONNECTOR}/utils.py",
            f"{_OFFLOADING_CONNECTOR}/test_config.py",  # imported for its helpers
        ),
        replacements=(
            Replacement(_VLLM_MANAGER_IMPORT, _VLLM_MANAGER_IMPORT + _KVOFF_IMPORT),
            Replacement(
                "    manager = CPUOffloadingManager(num_chunks=100)\n",
                "    manager = kvoff_cpu_manager(num_chunks=100)  # kvoff\n",
            ),
            Replacement(
                "    manager = CPUOffloadingManager(num_chunks=16)\n",
                "    manager = kvoff_cpu_manager(num_chunks=16)  # kvoff\n",
            ),
        ),
        forbidden=("CPUOffloadingManager(",),
        kvoff_markers=("kvoff_cpu_manager(",),
    ),
}


def cache_dir() -> Path:
    """Where the sdist is kept between runs: ``$KVOFF_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvoff`` (``~/.cache/kvoff``); never in the repository."""
    if os.environ.get("KVOFF_CACHE_DIR"):
        return Path(os.environ["KVOFF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvoff"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(timeout: float = 120.0) -> Path:
    """vLLM's sdist, downloaded once into :func:`cache_dir` and checked against
    :data:`SDIST_SHA256` (a cached file with another hash is downloaded again).

    Raises:
        DownloadError: it cannot be downloaded (the caller skips).
        AssertionError: the downloaded file's sha256 is not the pinned one.
    """
    path = cache_dir() / SDIST_URL.rsplit("/", 1)[1]
    if path.is_file() and _sha256(path) == SDIST_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=timeout) as response, part.open("wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{type(e).__name__}: {e}") from e
    digest = _sha256(part)
    if digest != SDIST_SHA256:
        part.unlink()
        raise AssertionError(f"{SDIST_URL} has sha256 {digest}, not the pinned {SDIST_SHA256}")
    part.replace(path)
    return path


def adapt(text: str, upstream: UpstreamFile) -> str:
    """``text`` (vLLM's file) with ``upstream``'s replacements applied.

    Raises:
        AdaptationError: a replacement's old text is not in ``text`` exactly once, or forbidden
            text remains.
    """
    for r in upstream.replacements:
        n = text.count(r.old)
        if n != 1:
            raise AdaptationError(
                f"{upstream.path}: the text to replace occurs {n} times, not once (vLLM's file "
                f"changed; update the replacement):\n{r.old}"
            )
        text = text.replace(r.old, r.new)
    for bad in upstream.forbidden:
        if bad in text:
            raise AdaptationError(f"{upstream.path}: {bad!r} is still there after the adaptation")
    return text


# vLLM's create_vllm_config() (tests/v1/kv_connector/unit/utils.py, used by the scheduler tests'
# RequestRunner) makes a ModelConfig for facebook/opt-125m, which reads only that model's
# config.json from the Hugging Face Hub. The run is offline with these fields of OPT-125m's
# config.json in a private HF cache: no network, and no minutes of retries where the Hub is
# unreachable.
_OPT_125M = "facebook/opt-125m"
_OPT_125M_CONFIG: dict[str, Any] = {
    "_name_or_path": _OPT_125M, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}  # fmt: skip


def _offline_hf_home(root: Path) -> Path:
    home = root / "hf"
    repo = home / "hub" / ("models--" + _OPT_125M.replace("/", "--"))
    revision = "0" * 40
    (repo / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(_OPT_125M_CONFIG))
    return home


def prepare_tree(sdist: Path, root: Path) -> Path:
    """Extracts the upstream files and their support files from ``sdist`` under ``root``
    (``root/tests/...``, as in vLLM's repository), adapted; returns ``root``.

    Raises:
        AdaptationError: see :func:`adapt`.
        KeyError: a file is not in the sdist.
    """
    wanted = {p for u in UPSTREAM_FILES.values() for p in (u.path, *u.support)}
    found: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            name = member.name.removeprefix(SDIST_PREFIX)
            if name in wanted and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                found[name] = f.read()
    missing = wanted - found.keys()
    if missing:
        raise KeyError(f"not in {sdist.name}: {sorted(missing)}")
    for name, data in found.items():
        text = data.decode()
        if name in UPSTREAM_FILES:
            text = adapt(text, UPSTREAM_FILES[name])
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (root / "pytest.ini").write_text("[pytest]\n")  # the rootdir; vLLM's own settings unneeded
    _offline_hf_home(root)
    return root


@dataclass
class UpstreamRun:
    """One upstream file's run: per test id (relative to the file, e.g.
    ``TestARCPolicy::test_basic`` or ``test_x[lru]``) its outcome, message and counts."""

    path: str
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0


def run_upstream(root: Path, path: str, timeout: float = 600.0) -> UpstreamRun:
    """Runs one adapted upstream file in a subprocess (rootdir ``root``, as in vLLM's
    repository) with vllm_upstream_plugin.py.

    Raises:
        AssertionError: the run did not complete (a crash, a collection error, a timeout).
    """
    import time

    report = root / (Path(path).stem + ".report.json")
    report.unlink(missing_ok=True)
    env = {
        **os.environ,
        "KVOFF_UPSTREAM_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }  # fmt: skip
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(name, None)  # they would win over HF_HOME
    cmd = [
        sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider",
        "-p", "vllm_upstream_plugin", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
    ]  # fmt: skip
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{path}: still running after {timeout:.0f} s") from e
    seconds = time.monotonic() - start
    tail = f"\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode in (0, 1), f"{path}: pytest exited with {proc.returncode}{tail}"
    assert report.is_file(), f"{path}: no report written{tail}"
    data = json.loads(report.read_text())
    assert not data["collect_errors"], f"{path}: collection failed: {data['collect_errors']}"
    assert data["tests"], f"{path}: no tests ran{tail}"
    prefix = f"{path}::"
    run = UpstreamRun(path=path, seconds=seconds)
    for nodeid, rec in data["tests"].items():
        tid = nodeid.removeprefix(prefix)
        run.outcomes[tid] = rec["outcome"]
        run.messages[tid] = rec["message"]
    for nodeid, counts in data["counts"].items():
        run.counts[nodeid.removeprefix(prefix)] = counts
    return run


def kvoff_functions(root: Path, upstream: UpstreamFile) -> set[str]:
    """The test functions (``name`` or ``Class::name``) of the adapted file whose source
    contains one of ``upstream.kvoff_markers``: they construct the manager or spec under
    test."""
    text = (root / upstream.path).read_text()
    tree = ast.parse(text)
    found: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{prefix}{node.name}::")
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                src = ast.get_source_segment(text, node) or ""
                if any(m in src for m in upstream.kvoff_markers):
                    found.add(prefix + node.name)

    visit(tree.body, "")
    return found


def function_of(test_id: str) -> str:
    """``TestX::test_y[params]`` -> ``TestX::test_y``."""
    return re.sub(r"\[.*\]$", "", test_id)
