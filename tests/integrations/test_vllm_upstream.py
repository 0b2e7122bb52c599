"""vLLM 0.32.0's own tests of its CPU offloading, run against kvoff (issue 53, item 6).

What it does: at test time, fetches vLLM's sdist from PyPI (once: it is cached outside the
repository, in ``$KVOFF_CACHE_DIR`` or ``~/.cache/kvoff/``, and its sha256 checked), extracts
three of vLLM's test files and the files they import (``__init__.py``, ``conftest.py``,
``utils.py``, ``test_config.py``) into a temporary ``tests/`` tree laid out as in vLLM's
repository, adapts them (below), and runs each file in a subprocess with pytest (rootdir the
temporary tree, so ``tests.v1...`` imports as in vLLM's repository) and the plugin
``vllm_upstream_plugin.py``, which records every upstream test's outcome and counts the
constructions of kvoff's and vLLM's managers and specs per test. Each upstream file is one kvoff
test here:

* ``tests/v1/kv_offload/cpu/test_manager.py``: vLLM's CPU manager unit tests, on kvoff's
  ``KvoffOffloadingManager``;
* ``tests/v1/kv_offload/test_factory.py``: vLLM's spec factory, whose "CPUOffloadingSpec" is
  kvoff's ``KvoffOffloadingSpec``;
* ``tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py``: vLLM's offloading
  scheduler. Most of its tests drive vLLM's ``OffloadingConnector`` over ``MockOffloadingSpec``
  (utils.py), whose manager is a ``MagicMock`` the tests script: they do not involve kvoff and
  are run as they are (they must pass: kvoff installed must not break them). The tests that
  build a real ``CPUOffloadingManager`` under vLLM's real scheduler
  (``test_swa_offload_window_covers_unaligned_hit``,
  ``test_swa_load_does_not_wait_for_unusable_pending_suffix``) get kvoff's manager.

Every upstream test must pass, or be in :data:`NOT_APPLICABLE` (outcome ignored: it tests vLLM's
internals or something kvoff does not offer) or in :data:`EXPECTED_TO_FAIL_UNTIL_FIXED` (a kvoff
gap being fixed; strict: such a test that passes fails here, so the entry is removed). Every
entry must name an upstream test (a test id, a test function covering its parametrizations, or a
test class). A passing test whose function builds the manager or spec under test must have
constructed kvoff's, and no test outside NOT_APPLICABLE may construct vLLM's
``CPUOffloadingManager`` or ``CPUOffloadingSpec``.

The sdist (from PyPI's simple index, https://pypi.org/simple/vllm/):
https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
sha256 d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad (44.5 MB;
``vllm_upstream.SDIST_URL`` / ``SDIST_SHA256``). Without network the tests skip, naming the URL;
without vLLM they skip (conftest.py).

Adaptation rule: only the lines that construct vLLM's manager or spec change, as explicit
(old text -> new text) replacements in ``vllm_upstream.UPSTREAM_FILES``; each old text must occur
exactly once (else the run fails, naming it), and text that would still construct vLLM's class
must not remain. No assertion changes. ``make_cpu_manager``'s body and the scheduler tests'
``CPUOffloadingManager(num_chunks=...)`` call ``vllm_upstream_plugin.kvoff_cpu_manager`` (kvoff's
manager with vLLM's arguments; an argument kvoff has no parameter for is a TypeError naming it
unless it has vLLM's "off" value); test_factory.py's ``CPUOffloadingSpec`` is kvoff's spec and
the factory's "CPUOffloadingSpec" entry returns it. vLLM's ``create_vllm_config`` (the scheduler
tests) reads facebook/opt-125m's config.json from the Hugging Face Hub: the subprocess is offline
with that config.json in a private HF cache (vllm_upstream.py), not a change to the tests.

To move to a new vLLM version: take the sdist's URL and sha256 from
``curl -H "Accept: application/vnd.pypi.simple.v1+json" https://pypi.org/simple/vllm/``, set
``VLLM_VERSION``, ``SDIST_URL`` and ``SDIST_SHA256`` in vllm_upstream.py, run this file, update
the replacements (and support files) where vLLM's text moved, and re-sort the tests it reports
into passing, NOT_APPLICABLE and EXPECTED_TO_FAIL_UNTIL_FIXED.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_upstream import (
    FACTORY,
    MANAGER,
    SCHEDULER,
    SDIST_URL,
    UPSTREAM_FILES,
    VLLM_VERSION,
    AdaptationError,
    DownloadError,
    UpstreamRun,
    adapt,
    fetch_sdist,
    function_of,
    kvoff_functions,
    prepare_tree,
    run_upstream,
)

pytestmark = pytest.mark.vllm

_POLICY = "reads vLLM's policy object (manager._policy: LRUCachePolicy/ARCCachePolicy internals)"
_ARC = "reads vLLM's ARCCachePolicy lists (manager._policy.t1/t2/b1/b2, target_t1_size)"
_CPU_SPEC_WORKER = (
    "calls vLLM's CPUOffloadingSpec.create_worker with vllm.v1.kv_offload.cpu.spec's "
    "SharedOffloadRegion/CPUOffloadingWorker/current_platform patched; kvoff's spec makes its own "
    "worker (get_worker) on any platform"
)
_CPU_SPEC_LAYOUT = (
    "vLLM's shared-region layout (cpu_page_size_per_worker, kv_bytes_per_chunk rounded to "
    "SharedOffloadRegion's mmap page, the replicated MLA layout on a CUDA-alike platform); kvoff "
    "sizes its pool by its invariant 3 and keeps a copy per rank"
)
_TIERING = "vLLM's TieringOffloadingSpec, which kvoff does not replace"
_SLOT_ORDER = (
    "expects which free CPU slots a store gets (store_chunk_ids [2, 3, 0] after evicting the "
    "block in slot 0), an allocation order no contract fixes; kvoff gives [0, 2, 3]"
)

#: upstream file -> {test id, function (all its parametrizations) or class: why it does not
#: apply to kvoff}. Their outcomes are ignored.
NOT_APPLICABLE: dict[str, dict[str, str]] = {
    MANAGER: {
        "TestARCPolicy": f"its _make_manager asserts and returns manager._policy; {_ARC}",
        "test_arc_counts_reuse_once_and_keeps_insertions_in_t1": _ARC,
        "test_arc_ghost_hit_adapts_once_per_request_before_insertion": _ARC,
        "test_arc_pending_chunk_is_not_a_frequency_hit": _ARC,
        "test_arc_reuse_wins_if_same_request_later_reinserts_key": _ARC,
        "test_reset_discards_stale_request_access_classification": _ARC,
        "test_lru_batch_eviction_failure_is_atomic": f"{_POLICY}: calls policy.evict()",
        "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": f"{_POLICY}: policy._heap",
        "test_touch_forwards_req_context_to_policy": "monkeypatches manager._policy.touch",
        "test_request_finish_forwards_grouped_deduplicated_accesses": (
            "monkeypatches manager._policy.on_request_finished"
        ),
        "test_failed_store_records_access_once_and_uses_store_miss_hook": (
            "monkeypatches manager._record_request_cache_access and _policy hooks"
        ),
        "test_cpu_manager_reports_allocation_size_on_allocation_failure": (
            "monkeypatches manager._allocate_chunks"
        ),
        "test_evictable_cache_chunk_count": "reads manager._num_evictable_cache_chunks",
        "test_filter_reused_manager": "reads vLLM's reuse tracker (manager.counts)",
        "test_store_threshold_does_not_hide_ready_reuse": (
            "reads vLLM's manager.stores_skipped_in_current_batch (its per-batch counter)"
        ),
        "test_already_stored_chunk_not_evicted_during_prepare_store": _SLOT_ORDER,
        "test_cpu_manager": (
            f"{_SLOT_ORDER} (its later checks, of eviction after on_request_finished, events and "
            "a failed store, are not reached)"
        ),
    },
    FACTORY: {
        "test_cpu_spec_create_worker_rank_assignment": _CPU_SPEC_WORKER,
        "test_cpu_spec_create_worker_uses_mmap_on_cuda": _CPU_SPEC_WORKER,
        "test_cpu_spec_create_worker_uses_tensor_path_without_shared_region": _CPU_SPEC_WORKER,
        "test_cpu_spec_create_worker_skips_mmap_for_empty_cache": _CPU_SPEC_WORKER,
        "test_cpu_spec_sizes_normalized_worker_layout": _CPU_SPEC_LAYOUT,
        "test_cpu_spec_zero_worker_bytes_produces_empty_cache": _CPU_SPEC_LAYOUT,
        "test_cpu_spec_replicated_sizing_on_shared_region": _CPU_SPEC_LAYOUT,
        "test_cpu_spec_replicated_disabled_without_shared_region": _CPU_SPEC_LAYOUT,
        "test_cpu_spec_replicated_layout_truth_matrix[cuda-True]": _CPU_SPEC_LAYOUT,
        "test_dynamic_load_via_spec_module_path": (
            "loads vLLM's own CPUOffloadingSpec by its module path (vllm.v1.kv_offload.cpu.spec)"
        ),
        "test_tiering_spec_registered": _TIERING,
        "test_tiering_spec_aligns_row_size": _TIERING,
        "test_tiering_spec_replicated_sizing_removes_world_factor": _TIERING,
        "test_tiering_spec_create_worker_uses_single_slot_for_replicated_layout": _TIERING,
        "test_tiering_spec_create_worker_uses_worker_rank_for_sharded_layout": _TIERING,
    },
    SCHEDULER: {},
}

#: upstream file -> {test id, function or class: the kvoff gap it fails on}. Strict: a listed
#: test that passes fails the kvoff test (remove its entry). Empty: the gaps vLLM's tests found
#: (chunk_ids, medium, vLLM's CPU metrics and metric definitions, store_threshold and
#: max_tracker_size, a 0-chunk manager, num_chunks, vLLM's message for a missing
#: cpu_bytes_to_use, eviction across KV groups by token position) are fixed.
EXPECTED_TO_FAIL_UNTIL_FIXED: dict[str, dict[str, str]] = {MANAGER: {}, FACTORY: {}, SCHEDULER: {}}


def _matches(key: str, test_id: str) -> bool:
    """A list key names a test id, a test function (all its parametrizations) or a class."""
    return key in (test_id, function_of(test_id)) or test_id.startswith(f"{key}::")


def _entry(entries: dict[str, str], test_id: str) -> str | None:
    for key, reason in entries.items():
        if _matches(key, test_id):
            return reason
    return None


class Upstream:
    """The adapted tree (made once per module) and each upstream file's run (made once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, UpstreamRun | AssertionError] = {}

    def run(self, path: str) -> UpstreamRun:
        if path not in self.runs:
            try:
                self.runs[path] = run_upstream(self.root, path)
            except AssertionError as e:  # a run that did not complete is not run again
                self.runs[path] = e
        run = self.runs[path]
        if isinstance(run, AssertionError):
            raise run
        return run


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Upstream:
    try:
        sdist = fetch_sdist()
    except DownloadError as e:
        pytest.skip(f"vLLM {VLLM_VERSION}'s sdist cannot be downloaded from {SDIST_URL}: {e}")
    return Upstream(prepare_tree(sdist, tmp_path_factory.mktemp("vllm_upstream")))


def _short(path: str) -> str:
    return Path(path).stem


def _problems(upstream: Upstream, path: str, run: UpstreamRun) -> list[str]:
    """What is wrong with one upstream file's run, one line per test function and kind of
    problem (nothing: the kvoff test passes)."""
    na, xfail = NOT_APPLICABLE[path], EXPECTED_TO_FAIL_UNTIL_FIXED[path]
    builds_kvoff = kvoff_functions(upstream.root, UPSTREAM_FILES[path])
    grouped: dict[tuple[str, str], list[str]] = {}  # (function, problem) -> test ids
    for tid, outcome in sorted(run.outcomes.items()):
        if _entry(na, tid) is not None:
            continue
        counts = run.counts.get(tid, {})
        found: list[str] = []
        if counts.get("vllm_manager") or counts.get("vllm_spec"):
            found.append(f"constructed vLLM's CPUOffloadingManager/Spec ({counts})")
        if _entry(xfail, tid) is not None:
            if outcome == "passed":
                found.append("passes now: remove it from EXPECTED_TO_FAIL_UNTIL_FIXED")
        elif outcome != "passed":
            found.append(f"{outcome}: {run.messages[tid][:300]}")
        elif function_of(tid) in builds_kvoff and not (
            counts.get("kvoff_manager") or counts.get("kvoff_spec")
        ):
            found.append("passed without constructing kvoff's manager or spec")
        for problem in found:
            grouped.setdefault((function_of(tid), problem), []).append(tid)
    return [
        f"{tids[0] if len(tids) == 1 else f'{fn} ({len(tids)} parametrizations)'}: {problem}"
        for (fn, problem), tids in grouped.items()
    ]


@pytest.mark.parametrize("path", list(UPSTREAM_FILES), ids=_short)
def test_vllm_upstream_tests_on_kvoff(upstream: Upstream, path: str) -> None:
    """Every upstream test of the file passes on kvoff, or is listed (see the module)."""
    run = upstream.run(path)
    kvoff_built = sum(
        c.get("kvoff_manager", 0) + c.get("kvoff_spec", 0) for c in run.counts.values()
    )
    assert kvoff_built > 0, f"{path}: no upstream test constructed kvoff's manager or spec"
    problems = _problems(upstream, path, run)
    passed = sum(o == "passed" for o in run.outcomes.values())
    if problems:
        pytest.fail(
            f"{path}: {len(run.outcomes)} upstream tests, {passed} passed ({run.seconds:.0f} s); "
            f"problems:\n" + "\n".join(problems),
            pytrace=False,
        )


@pytest.mark.parametrize("path", list(UPSTREAM_FILES), ids=_short)
def test_lists_name_upstream_tests(upstream: Upstream, path: str) -> None:
    """Every NOT_APPLICABLE and EXPECTED_TO_FAIL_UNTIL_FIXED entry names an upstream test that
    ran (so the lists cannot rot), and no test is in both."""
    run = upstream.run(path)
    na, xfail = NOT_APPLICABLE[path], EXPECTED_TO_FAIL_UNTIL_FIXED[path]
    stale = [k for k in [*na, *xfail] if not any(_matches(k, tid) for tid in run.outcomes)]
    assert not stale, f"{path}: listed but not an upstream test: {stale}"
    both = [tid for tid in run.outcomes if _entry(na, tid) and _entry(xfail, tid)]
    assert not both, f"{path}: in both NOT_APPLICABLE and EXPECTED_TO_FAIL_UNTIL_FIXED: {both}"


def test_adaptation_fails_loudly_when_vllm_text_changed() -> None:
    """A replacement whose text is not in vLLM's file stops the run (no network needed): an
    unadapted file would silently test vLLM's own manager."""
    upstream = UPSTREAM_FILES[MANAGER]
    with pytest.raises(AdaptationError, match="occurs 0 times"):
        adapt("def make_cpu_manager():\n    return None\n", upstream)
    text = "".join(r.old for r in upstream.replacements)
    with pytest.raises(AdaptationError, match="occurs 2 times"):
        adapt(text + text, upstream)
    adapted = adapt(text, upstream)
    assert "kvoff_cpu_manager(" in adapted
    assert "CPUOffloadingManager(" not in adapted
