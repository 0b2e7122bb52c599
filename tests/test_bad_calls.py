"""Bad calls into the scheduler, the manager and the worker (docs/design.md invariant 7: bad input
is rejected with an error that names the value, and changes nothing). Each case here came out of
an audit of the public API (2026-11-25) and failed before its fix: a process crash, a lost job
result, a request left registered by a refused call, a string read as a success or as a list
of ids, a huge count allocating gigabytes, an infinite timeout returning at once."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from scheduler_harness import EngineSim, snapshot
from torch._subclasses.fake_tensor import FakeTensorMode

from kvoff import (
    CPUBlockSpec,
    CPUOffloadingManager,
    GPUBlockSpec,
    OffloadingEvent,
    OffloadingWorker,
    PrepareStoreOutput,
    copy_blocks,
)
from kvoff.config import parse_byte_size
from kvoff.scheduler import OffloadingScheduler, Request


def _sim_with_store_in_flight() -> tuple[EngineSim, int]:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    sim.add_request("a", list(range(9)))
    (store,) = sim.step().meta.store_jobs
    return sim, store.job_id


def test_a_key_whose_index_changes_the_key_list_does_not_crash() -> None:
    """``__index__`` is user code run while the binding reads the list: it must not be able to
    free the bytes objects the binding already views (this was a segfault)."""
    script = textwrap.dedent(
        """
        from kvoff import CPUOffloadingManager
        keys = []
        class Key:
            def __index__(self):
                keys.clear()
                keys.extend(bytes([i % 256]) * 64 for i in range(1000))
                return 7
        keys.extend([b"\\x01" * 100000, Key(), b"\\x02" * 100000])
        m = CPUOffloadingManager(64)
        out = m.prepare_store(keys)
        assert out is not None and len(out.keys_to_store) == 3, out
        assert out.keys_to_store[0] == b"\\x01" * 100000
        assert out.keys_to_store[1] == (7).to_bytes(8, "little")
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr)


class _OnlyAnId:
    request_id = "a"


def test_objects_that_are_no_request_or_step_are_named_and_change_nothing() -> None:
    """AttributeError ('int' object has no attribute 'request_id') before."""
    from kvoff.scheduler import ScheduledRequest, SchedulerStep

    sim, _ = _sim_with_store_in_flight()
    s = sim.sched
    before = snapshot(s, [], ["a"])
    ok = ScheduledRequest("a", (), 8, 1)
    needs = r"request must have request_id, block_hashes, num_tokens.*, got "
    cases = [
        (lambda: s.get_num_new_matched_tokens(5, 0), needs + r"int 5 .*nothing was changed"),
        (lambda: s.get_num_new_matched_tokens(_OnlyAnId(), 0), needs + r"_OnlyAnId .*block_hashes"),
        (lambda: s.update_state_after_alloc(b"a", [[1]], 0), needs + r"bytes b'a'"),
        (lambda: s.offload_key("a", 0), needs + r"str 'a'"),
        (lambda: s.build_connector_meta([]), r"step must have the fields of a SchedulerStep"),
        (
            lambda: s.build_connector_meta(SchedulerStep(scheduled=[ok, 3])),
            r"step must have .*'int' object has no attribute 'request_id'",
        ),
    ]
    for call, match in cases:
        with pytest.raises(TypeError, match=match):
            call()
        assert snapshot(s, [], ["a"]) == before
    sim.step()  # the engine goes on


def test_a_request_without_num_prompt_tokens_is_named_under_offload_prompt_only() -> None:
    from kvoff.scheduler import OffloadingScheduler

    s = OffloadingScheduler(EngineSim(block_size=4).spec, offload_prompt_only=True)

    class NoPrompt:
        request_id = "p"
        block_hashes = (b"h1", b"h2")
        num_tokens = 9

    for call in (
        lambda: s.get_num_new_matched_tokens(NoPrompt(), 0),
        lambda: s.update_state_after_alloc(NoPrompt(), [[1, 2, 3]], 0),
    ):
        with pytest.raises(
            TypeError,
            match=r"with offload_prompt_only, num_prompt_tokens .*got "
            r"NoPrompt .*no attribute 'num_prompt_tokens'.*nothing was changed",
        ):
            call()
        assert s.stats()["num_requests"] == 0 and s._requests == {}
    assert s.get_num_new_matched_tokens(Request("p", [b"h1", b"h2"], 9), 0) == (0, False)


def test_summed_counts_beyond_world_size_are_refused_before_any_allocation() -> None:
    sim, job = _sim_with_store_in_flight()
    s = sim.sched
    before = snapshot(s, [], ["a"])
    for counts in ((10**12, 0), (0, 10**12), (1, 1)):  # 10**12 reports: a terabyte before
        with pytest.raises(ValueError, match=r"reports more ranks than world_size = 1"):
            s.update_connector_output_counts({job: counts})
    assert snapshot(s, [], ["a"]) == before
    s.update_connector_output_counts({job: (1, 0)})  # the job is still there to complete


def test_a_refused_first_call_leaves_no_request_registered() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8)
    s = sim.sched
    for i in range(50):
        with pytest.raises(ValueError, match="num_computed_tokens 3"):
            s.get_num_new_matched_tokens(Request(f"x{i}", [b"h1", b"h2"], 9), 3)
        with pytest.raises(ValueError, match="block id 999"):
            s.update_state_after_alloc(Request(f"y{i}", [b"h1", b"h2"], 9), [[1, 999]], 0)
    assert s.stats()["num_requests"] == 0 and s._requests == {}
    # a known request refused later keeps its registration
    r = Request("k", [b"h1", b"h2"], 9)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    with pytest.raises(ValueError, match="num_computed_tokens 3"):
        s.get_num_new_matched_tokens(r, 3)
    assert s.stats()["num_requests"] == 1 and list(s._requests) == ["k"]


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (((1.9, 2),), r"new_block_ids\[0\]\[0\] must be an int GPU block id, got 1.9"),
        (((1, "2"),), r"new_block_ids\[0\]\[1\] must be an int GPU block id, got '2'"),
        (((1, 2), (True,)), r"new_block_ids\[1\]\[0\] must be an int GPU block id, got True"),
        ((5,), r"new_block_ids\[0\] must be a sequence of GPU block ids, got 5"),
        (None, "new_block_ids must be a sequence of block id sequences"),
    ],
)
def test_a_scheduled_request_refuses_block_ids_that_are_not_ints(table, match) -> None:  # type: ignore[no-untyped-def]
    """``int(1.9)`` made block 1, and the step stored GPU block 1 under block 2's key."""
    from kvoff.scheduler import ScheduledRequest

    with pytest.raises(TypeError, match=match):
        ScheduledRequest("a", table)
    ok = ScheduledRequest("a", ((np.int64(1), 2),))
    assert ok.new_block_ids == ((1, 2),) and type(ok.new_block_ids[0][0]) is int


def test_sizes_that_overflow_the_core_are_refused_before_it_runs() -> None:
    """A GPU block size whose product with block_size_factor wrapped int64 to 0 killed the
    process (SIGFPE) at the first lookup; a CPU pool of more than 2**31 - 1 blocks reached
    the core's constructor as a pybind11 argument dump. Run in a subprocess: a crash fails
    the test instead of the session."""
    script = textwrap.dedent(
        """
        import torch
        from kvoff import (CPUOffloadingSpec, FullAttentionSpec, KVCacheConfig,
                           KVCacheGroupSpec, KVCacheTensor)
        from kvoff.scheduler import OffloadingScheduler, Request
        def spec(gpu_bs, factor, cpu_bytes):
            layer = FullAttentionSpec(gpu_bs, 1, 1, torch.uint8)
            page = layer.page_size_bytes
            kv = KVCacheConfig(1, [KVCacheTensor(page, ("l0",))],  # below 2**63 bytes
                               [KVCacheGroupSpec(("l0",), layer)])
            return CPUOffloadingSpec(kv, cpu_bytes_to_use=cpu_bytes, block_size=gpu_bs * factor)
        for args, want in (((2**61, 8, 2**70), "2^31 tokens"),
                           ((16, 1, 2**80), "at most 2**31 - 1")):
            try:
                s = OffloadingScheduler(spec(*args))
                s.get_num_new_matched_tokens(Request("r", [b"h"] * 4, 2**62), 0)
            except ValueError as e:
                assert want in str(e), e
            else:
                raise AssertionError(f"accepted {args}")
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr)


def test_compute_num_cpu_blocks_takes_whole_numbers_only() -> None:
    """Invariant 3's one sizing function returned NaN or a float slot count for float input,
    and 0 for numpy ints whose product wrapped around."""
    from kvoff.sizing import compute_num_cpu_blocks

    for args in ((1000, float("nan"), 1, 1), (float("inf"), 10, 1, 1), (1000, 4.5, 1, 1),
                 (1000, 10, 1, True), ("1000", 10, 1, 1)):  # fmt: skip
        with pytest.raises(TypeError, match="must be an int"):
            compute_num_cpu_blocks(*args)
    big = np.int64(2**40)
    assert compute_num_cpu_blocks(big * 2**20, big, np.int64(2**20), 1) == 1
    assert type(compute_num_cpu_blocks(np.int64(1000), 10, 1)) is int


def test_finished_ids_as_a_one_shot_iterator_release_the_request() -> None:
    s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    assert s.get_num_new_matched_tokens(Request("z", [b"h1", b"h2"], 9), 0) == (0, False)
    assert list(s._requests) == ["z"]
    s.build_connector_meta_columns([], [], [], [], finished_request_ids=iter(["z"]))
    assert s.stats()["num_requests"] == 0 and s._requests == {}


def test_a_str_is_not_read_as_a_collection_of_request_ids() -> None:
    sim, _ = _sim_with_store_in_flight()
    s = sim.sched
    before = snapshot(s, [], ["a"])
    for kwargs, name in (
        ({"finished_request_ids": "a"}, "finished_request_ids"),
        ({"preempted_request_ids": "a"}, "preempted_request_ids"),
        ({"resumed_request_ids": "xaz"}, "resumed_request_ids"),
    ):
        with pytest.raises(TypeError, match=rf"{name} must be a collection of request ids"):
            s.build_connector_meta_columns([], [], [], [], **kwargs)
    with pytest.raises(TypeError, match="request_ids must be a collection"):
        s.build_connector_meta_columns("a", [None], [0], [0])
    assert snapshot(s, [], ["a"]) == before


@pytest.mark.parametrize(
    ("report", "error", "match"),
    [
        (lambda j: (j, "False"), TypeError, "success='False'"),
        (lambda j: (j + 0.7, False), TypeError, "must be an int"),
        (lambda j: (str(j), True), TypeError, "must be an int"),
        (lambda j: (j,), ValueError, "pair"),
        (lambda j: [j, True], TypeError, "must be a JobReport"),
    ],
)
def test_a_report_the_scheduler_would_misread_is_refused(report, error, match) -> None:  # type: ignore[no-untyped-def]
    sim, job = _sim_with_store_in_flight()
    s = sim.sched
    before = snapshot(s, [], ["a"])
    with pytest.raises(error, match=match):
        s.update_connector_output([report(job)])
    assert snapshot(s, [], ["a"]) == before  # the store is still pending, not a hit


def test_the_core_refuses_a_report_whose_success_is_no_bool() -> None:
    """Below the Python checks, the C++ scheduler's own binding reads a report's success as
    a bool only: pybind11's conversion would read None as False and fail the store."""
    sim, job = _sim_with_store_in_flight()
    s = sim.sched
    before = snapshot(s, [], ["a"])
    for success in (None, 1, "True"):
        with pytest.raises(TypeError, match=r"success must be a bool \(True or False\), got"):
            s._core.update_connector_output([(job, success)])
    assert snapshot(s, [], ["a"]) == before


@pytest.mark.parametrize("flag", [None, 0, 1, "False", 0.0])
def test_manager_flags_are_bools_and_a_refused_call_changes_nothing(flag: object) -> None:
    """pybind11's bool conversion takes None (and anything with ``__bool__`` in some
    builds) as a flag: ``complete_store(keys, success=None)`` dropped the stores. Every flag of
    the manager is read as True / False (numpy's bool too), or refused naming it."""
    m = CPUOffloadingManager(4, enable_events=True)
    assert m.prepare_store([b"a", b"b"]) is not None
    m.complete_store([b"a"])
    calls = {
        "success": lambda: m.complete_store([b"b"], success=flag),
        "write_through": lambda: m.complete_store([b"b"], write_through=flag),
        "apply_threshold": lambda: m.prepare_store([b"c"], apply_threshold=flag),
        "include_in_flight": lambda: m.clear(include_in_flight=flag),
        "enable_events": lambda: CPUOffloadingManager(4, enable_events=flag),
        "removed": lambda: OffloadingEvent([b"a"], removed=flag),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\), got"):
            call()
    # nothing changed: b is still pending, a still a hit, c never got a slot
    assert m.lookup([b"a"]) == 1 and m.lookup([b"b"]) is None and b"c" not in m  # None: pending
    m.take_events()
    m.complete_store([b"b"], success=np.bool_(True))  # numpy's bool is a bool
    assert m.lookup([b"a", b"b"]) == 2
    assert OffloadingEvent([b"a"], removed=np.True_).removed is True


def test_offload_key_refuses_a_negative_block_and_an_unknown_group() -> None:
    sim, _ = _sim_with_store_in_flight()
    s, req = sim.sched, sim.requests["a"].req
    assert s.offload_key(req, 1) == bytes(req.block_hashes[1]) + b"\x00"
    with pytest.raises(ValueError, match="block=-1"):
        s.offload_key(req, -1)
    for group in (1, 300, -1):
        with pytest.raises(ValueError, match=f"group={group} is not a KV cache group"):
            s.offload_key(req, 0, group)


def test_counters_delta_refuses_values_that_are_not_earlier_counters() -> None:
    sim, _ = _sim_with_store_in_flight()
    s = sim.sched
    now = s.counters()
    assert s.counters_delta(now) == (None, now)
    with pytest.raises(ValueError, match=r"seen\[0\].* = -1 is not an earlier value"):
        s.counters_delta((-1,) * len(now))
    ahead = (now[0] + 1, *now[1:])
    with pytest.raises(ValueError, match="is not an earlier value"):
        s.counters_delta(ahead)


def test_write_through_waits_forever_on_inf_and_refuses_nan() -> None:
    m = CPUOffloadingManager(8)
    m.set_write_through(2)
    for call in (m.take_write_through, m.wait_write_through):
        with pytest.raises(ValueError, match="NaN"):
            call(float("nan"))
    closer = threading.Timer(0.3, m.close_write_through)
    closer.start()
    t0 = time.perf_counter()
    assert m.take_write_through(float("inf")) == []  # woken by close, not returned at once
    assert time.perf_counter() - t0 >= 0.25
    t0 = time.perf_counter()
    assert m.take_write_through(1e18) == []  # closed: at once
    assert time.perf_counter() - t0 < 0.25


def test_worker_wait_with_an_unknown_id_takes_no_result() -> None:
    kv = torch.zeros((8, 2, 4, 2, 8), dtype=torch.bfloat16)
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=4)
    w.register_kv_caches({"l0": kv})
    assert w.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((0,)))
    with pytest.raises(KeyError, match=r"unknown job ids \[99\].*nothing was taken"):
        w.wait([1, 99])
    assert w.pending_jobs() == {1}  # job 1's result is still there to report
    (r,) = w.wait([1])
    assert r.job_id == 1 and r.success


@pytest.mark.parametrize(
    ("job_ids", "match"),
    [
        (1, r"job_ids must be a list of job ids \(ints\), got int 1; wrap a single id"),
        (None, r"got NoneType None"),
        ("1", r"got str '1'"),
        (torch.tensor(1), r"got Tensor tensor\(1\)"),
        ([1, None], r"job_ids\[1\]: job_id must be an int, got None \(NoneType\)"),
        ([[1]], r"job_ids\[0\]: job_id must be an int, got \[1\] \(list\)"),
    ],
)
def test_worker_wait_and_fence_name_job_ids_that_are_no_list_of_ints(job_ids, match) -> None:  # type: ignore[no-untyped-def]
    """'int' object is not iterable, or unhashable type: 'list', before."""
    kv = torch.zeros((8, 2, 4, 2, 8), dtype=torch.bfloat16)
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=4)
    w.register_kv_caches({"l0": kv})
    assert w.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((0,)))
    with pytest.raises(TypeError, match=match + ".*[Nn]othing was taken"):
        w.wait(job_ids)
    with pytest.raises(TypeError, match=match + ".*[Nn]othing was ordered"):
        w.fence(job_ids)
    assert w.pending_jobs() == {1}  # job 1's result is still there to report
    (r,) = w.wait(np.array([1]))
    assert r.job_id == 1 and r.success


def test_meta_tensors_are_refused() -> None:
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=4)
    with pytest.raises(ValueError, match="meta device"):
        w.register_kv_caches({"l0": torch.empty((8, 2, 4, 2, 8), device="meta")})


def test_a_byte_count_too_large_names_the_value() -> None:
    for text in ("1e400", "9.3e18"):
        with pytest.raises(ValueError, match=f"'{text}' is too large a byte count"):
            parse_byte_size(text)


def test_token_counts_that_would_overflow_their_sum_are_refused() -> None:
    s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    r = Request("t", [b"h1", b"h2"], 9)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, [[1, 2, 3]], 0)
    before = snapshot(s, [], ["t"])
    big = 2**63 - 1
    for computed, scheduled in ((big, big), (0, big), (2**61 + 1, 0)):
        with pytest.raises(ValueError, match=r"must be in \[0, 2\^61\]"):
            s.build_connector_meta_columns(["t"], [[[1, 2, 3]]], [computed], [scheduled])
        assert snapshot(s, [], ["t"]) == before
    s.build_connector_meta_columns(["t"], [[[1, 2, 3]]], [0], [9])  # the request is intact


def test_a_pool_too_large_says_both_bounds() -> None:
    with pytest.raises(ValueError, match=r"at least one block, and for at most 2\^31-1"):
        CPUOffloadingManager(2**31)


def test_request_finished_with_neither_a_request_nor_an_id() -> None:
    s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    for bad in (5, None, b"a"):
        with pytest.raises(TypeError, match="takes a request or its str id"):
            s.request_finished(bad)  # type: ignore[arg-type]
    assert s.request_finished("never-seen") is False


def test_block_specs_take_ints_only() -> None:
    assert CPUBlockSpec((3, 0)).block_ids == (3, 0)
    for bad, match in (("12", "sequence of ints"), ((1.9,), "1.9"), (("3",), "'3'")):
        with pytest.raises(TypeError, match=match):
            CPUBlockSpec(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=match):
            GPUBlockSpec(bad, (1,), (0,))  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [None, 0, "False", 1.0])
def test_scheduler_and_worker_flags_that_are_no_bool_are_refused_naming_them(flag: object) -> None:
    """``bool(flag)`` read "False" as True and None as False: a scheduler made with
    ``offload_prompt_only="False"`` stored prompt blocks only. Every flag of the two
    constructors is a bool (numpy's too) or a TypeError naming it (``pin_memory`` may be None,
    its default: pin when CUDA is there)."""
    spec = EngineSim(block_size=4).spec
    for name in ("enable_events", "offload_prompt_only"):
        with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\), got"):
            OffloadingScheduler(spec, **{name: flag})
    for name in ("pin_memory", "attach_shared_memory"):
        if name == "pin_memory" and flag is None:
            continue
        with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False"):
            OffloadingWorker(8, 4, **{name: flag})
    s = OffloadingScheduler(spec, enable_events=np.True_, offload_prompt_only=np.False_)
    assert s.stats()["num_cpu_blocks"] == spec.num_blocks
    assert OffloadingWorker(8, 4, pin_memory=None).pin_memory is torch.cuda.is_available()


def test_pool_tier_and_node_pool_flags_that_are_no_bool_are_refused_before_anything() -> None:
    """The same for the CPU pool, the tier coordinator and the node pool's client: the flag is
    named before memory is allocated, a thread starts or a socket is opened (the client's
    socket path does not exist, so any later step would raise NodePoolError instead)."""
    from kvoff.node_pool import NodePoolClient
    from kvoff.pinned import HostPool
    from kvoff.tiers.coordinator import TieredPool

    bool_error = r" must be a bool \(True or False\), got "
    for name in ("pin", "attach", "outlive_creator"):
        kw = {"pin": False, name: "False"}
        with pytest.raises(TypeError, match=name + bool_error + "str"):
            HostPool([(4, 64)], **kw)  # type: ignore[arg-type]
    manager = CPUOffloadingManager(4)
    with pytest.raises(TypeError, match="wait_when_full" + bool_error + "NoneType"):
        TieredPool(manager, lambda i: np.zeros(64, np.uint8), [], wait_when_full=None)
    for name in ("key_filter", "reserve"):
        with pytest.raises(TypeError, match=name + bool_error + "int"):
            NodePoolClient("/nonexistent/pool.sock", b"fp", **{name: 1})  # type: ignore[arg-type]
    assert HostPool([(4, 64)], pin=np.False_).tensors[0].shape == (4, 64)


def test_a_resumed_flag_that_is_no_bool_is_refused_and_the_step_is_as_without_it() -> None:
    """``ScheduledRequest(..., resumed_from_preemption="False")`` read as resumed: the request's
    block table was replaced by its new blocks, and later stores copied the wrong GPU blocks."""
    from kvoff.scheduler import ScheduledRequest, SchedulerStep

    s = OffloadingScheduler(EngineSim(block_size=4).spec)
    req = Request("r", [b"h1", b"h2", b"h3"], 12)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, [], 0)
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match=r"resumed_from_preemption must be a bool"):
            ScheduledRequest("r", ((5, 6, 7),), 0, 12, bad)  # type: ignore[arg-type]
    meta = s.build_connector_meta(
        SchedulerStep((ScheduledRequest("r", ((5, 6, 7),), 0, 12, np.False_),))
    )
    assert [j.gpu.block_ids for j in meta.store_jobs] == [(5, 6, 7)]


def test_worker_sizes_of_the_wrong_type_name_the_argument() -> None:
    for kwargs, name in (
        ({"num_gpu_blocks": "8", "num_cpu_blocks": 4}, "num_gpu_blocks"),
        ({"num_gpu_blocks": 8, "num_cpu_blocks": True}, "num_cpu_blocks"),
        ({"num_gpu_blocks": 8, "num_cpu_blocks": 4, "staging_bytes": None}, "staging_bytes"),
    ):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            OffloadingWorker(**kwargs)  # type: ignore[arg-type]


def test_token_counts_of_the_wrong_type_name_the_argument() -> None:
    s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    r = Request("t", [b"h1", b"h2"], 9)
    for bad in (4.0, None, True):
        with pytest.raises(TypeError, match="num_computed_tokens must be an int"):
            s.get_num_new_matched_tokens(r, bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="num_external_tokens must be an int"):
            s.update_state_after_alloc(r, [], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_computed_tokens=1180591620717411303424 does not"):
        s.get_num_new_matched_tokens(r, 2**70)
    assert s.stats()["num_requests"] == 0


def test_user_code_cannot_change_the_step_columns_while_they_are_read() -> None:
    """A str subclass, a container or a block-id sequence written in Python would run user
    code (__hash__, __contains__, __iter__) while the binding reads the step's lists through
    borrowed pointers: each is refused or copied first, and the process survives."""
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from scheduler_harness import EngineSim
        from kvoff.scheduler import Request
        s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
        for rid in ("a", "b"):
            s.get_num_new_matched_tokens(Request(rid, [b"h1", b"h2"], 9), 0)
            s.update_state_after_alloc(Request(rid, [b"h1", b"h2"], 9), [[1, 2, 3]], 0)
        ids = ["a", "b"]
        blocks = [None, None]
        def clobber():
            ids[:] = [str(i) * 5000 for i in range(100)]
            blocks[:] = [[[i]] for i in range(100)]

        class Id(str):
            def __hash__(self):
                clobber()
                return 1

        class Resumed:
            def __contains__(self, x):
                clobber()
                return False
            def __iter__(self):
                return iter(())

        class Blocks(list):
            def __iter__(self):
                clobber()
                return super().__iter__()

        outcomes = []
        def attempt(**kw):
            try:
                s.build_connector_meta_columns(list(ids), list(blocks), [0, 0], [1, 1], **kw)
                outcomes.append("ok")
            except TypeError as e:
                outcomes.append("TypeError: " + str(e)[:120])

        ids[0] = Id("a"); attempt(); ids[:] = ["a", "b"]
        attempt(resumed_request_ids=Resumed())
        blocks[:] = [Blocks([[4]]), None]; attempt(); blocks[:] = [None, None]
        print(outcomes)
        """
    )
    harness = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", script, harness], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    out = proc.stdout
    assert "request_ids[0] must be a str request id, got the str subclass Id" in out
    assert "new_block_ids[0] must be a list or tuple, got the Python class Blocks" in out
    assert out.count("'ok'") == 1  # the custom container was read once, as a frozenset


@pytest.mark.skipif(sys.platform != "linux", reason="caps the address space (RLIMIT_AS, /proc)")
def test_a_pool_too_large_for_the_host_is_a_memory_error_that_names_it() -> None:
    """A bare ``MemoryError('std::bad_alloc')`` before. Run with the address space capped 1 GiB
    above what the process uses, so that on any machine one of the two paths is taken: a pool
    larger than the host is refused before allocating; one that fits the host but not the cap
    fails to allocate. Both name num_blocks and the fix, through the manager and through the
    scheduler of a spec, and free what they had allocated."""
    script = textwrap.dedent(
        """
        import resource, sys
        sys.path.insert(0, sys.argv[1])
        from scheduler_harness import GroupDesc, build_spec
        from kvoff import CPUOffloadingManager
        from kvoff.scheduler import OffloadingScheduler

        def vm_bytes():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        return int(line.split()[1]) * 1024

        spec, _ = build_spec(
            (GroupDesc(),), block_size=4, num_gpu_blocks=32, num_cpu_blocks=2**31 - 1
        )
        cap = vm_bytes() + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        calls = [
            lambda: CPUOffloadingManager(2**31 - 1),
            lambda: CPUOffloadingManager(2**25, "arc"),
            lambda: OffloadingScheduler(spec),
        ]
        for call in calls:
            try:
                call()
                print("no error")
            except MemoryError as e:
                print(type(e).__name__, e)
        print("fits", CPUOffloadingManager(2**22).num_blocks)
        """
    )
    harness = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", script, harness], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    cases = ((2**31 - 1, "lru"), (2**25, "arc"), (2**31 - 1, "lru"))
    for line, (n, policy) in zip(lines[:3], cases, strict=True):
        assert line.startswith("MemoryError CPUOffloadingManager: "), line
        assert f"num_blocks={n} needs about " in line, line
        assert "GiB of host memory (~1" in line and f"'{policy}' eviction policy" in line, line
        assert "a smaller cpu_bytes_to_use" in line, line
    assert lines[3] == f"fits {2**22}"  # what the failed attempts allocated was freed


def _copy_args() -> dict:
    """Two healthy pairs of CPU block tensors and ids (tests/test_ops.py's conventions: the bad
    value goes last, and a refused call must leave every dst byte unchanged)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "src": [torch.randn(8, 2, 4, generator=gen), torch.randn(6, 16, generator=gen)],
        "dst": [torch.randn(5, 8, generator=gen), torch.randn(7, 4, 4, generator=gen)],
        "src_ids": [0, 1, 2],
        "dst_ids": [2, 3, 4],
    }


@pytest.mark.parametrize(
    ("key", "ids", "match"),
    [
        ("src_ids", [0, 1, 2**63], r"src_block_ids\[2\] = 9223372036854775808 is out of range"),
        ("dst_ids", [2, 3, 2**63], r"dst_block_ids\[2\] = 9223372036854775808 is out of range"),
        ("src_ids", [2**63], r"src_block_ids\[0\] = 9223372036854775808 is out of range"),
        ("src_ids", [0, 1, 2**64], r"src_block_ids\[2\] = 18446744073709551616 is out of"),
        ("src_ids", [0, 1, -(2**63) - 1], r"src_block_ids\[2\] = -9223372036854775809 is neg"),
        (
            "dst_ids",
            np.array([2, 3, 2**63 + 5], dtype=np.uint64),
            r"dst_block_ids\[2\] = 9223372036854775813 is out of range",
        ),
    ],
    ids=["src-2**63", "dst-2**63", "alone", "2**64", "below-int64", "uint64-array"],
)
def test_copy_blocks_ids_beyond_int64_are_refused_naming_them(key, ids, match) -> None:  # type: ignore[no-untyped-def]
    """2**63 wrapped to -2**63 ("is negative") or made the list float64 ("must hold
    integers")."""
    args = _copy_args()
    args[key] = ids
    before = [t.clone() for t in args["dst"]]
    with pytest.raises(IndexError, match=r"^kvoff\.copy_blocks: " + match + r".*\[0, size\(0\)\)"):
        copy_blocks(args["src"], args["dst"], args["src_ids"], args["dst_ids"])
    assert all(torch.equal(a, b) for a, b in zip(args["dst"], before, strict=True))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("src", "one", r"src must be a list or tuple of tensors \(one per layer\), got one tensor "
                       r"of shape \[8, 2, 4\]; pass \[src\]"),
        ("dst", "one", r"dst must be .*got one tensor of shape \[5, 8\]; pass \[dst\]"),
        ("src", None, r"src must be a list or tuple of tensors \(one per layer\), got NoneType"),
        ("dst", [None], r"dst\[0\] must be a tensor, got NoneType None"),
    ],
    ids=["one-src", "one-dst", "none", "none-item"],
)  # fmt: skip
def test_copy_blocks_refuses_tensors_not_given_as_a_list(key, value, match) -> None:  # type: ignore[no-untyped-def]
    """One tensor for src and dst was taken as the list of its rows before: the copy ran, row
    by row of every block, with another meaning ('NoneType' object is not iterable for None)."""
    args = _copy_args()
    if value == "one":
        value = args[key][0]
    args[key] = value
    dst = [t for t in args["dst"]] if isinstance(args["dst"], list) else [args["dst"]]
    before = [t.clone() for t in dst if isinstance(t, torch.Tensor)]
    with pytest.raises(TypeError, match=r"^kvoff\.copy_blocks: " + match):
        copy_blocks(args["src"], args["dst"], args["src_ids"], args["dst_ids"])
    after = [t for t in dst if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # a dict's values, or any other iterable of tensors, is a list of tensors
    good = _copy_args()
    copy_blocks(iter(good["src"]), dict(enumerate(good["dst"])).values(), [0], [1])


def _sparse(key: str, index: int | None, to: str) -> object:
    def mutate(a: dict) -> None:
        t = torch.as_tensor(a[key]) if index is None else a[key][index]
        t = t.to_sparse() if to == "coo" else t.reshape(t.shape[0], -1).to_sparse_csr()
        if index is None:
            a[key] = t
        else:
            a[key][index] = t

    return mutate


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("call", ["wrapper", "op", "fake"])
@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_sparse("src", 1, "coo"), r"src\[1\] is a torch.sparse_coo tensor \(shape \[6, 16\]\)"),
        (_sparse("dst", 1, "coo"), r"dst\[1\] is a torch.sparse_coo tensor \(shape \[7, 4, 4\]"),
        (_sparse("dst", 1, "csr"), r"dst\[1\] is a torch.sparse_csr tensor \(shape \[7, 16\]\)"),
        (_sparse("src_ids", None, "coo"), r"src_block_ids is a torch.sparse_coo tensor"),
        (_sparse("dst_ids", None, "coo"), r"dst_block_ids is a torch.sparse_coo tensor"),
    ],
    ids=["src", "dst", "dst-csr", "src-ids", "dst-ids"],
)
def test_copy_blocks_sparse_tensors_are_refused_naming_them(call: str, mutate, match) -> None:  # type: ignore[no-untyped-def]
    """torch's own NotImplementedError ("Could not run 'kvoff::copy_blocks' with arguments
    from the 'SparseCPU' backend") before."""
    args = _copy_args()
    mutate(args)
    for key in ("src_ids", "dst_ids"):
        if not isinstance(args[key], torch.Tensor):
            args[key] = torch.tensor(args[key])
    dense_dst = [t for t in args["dst"] if t.layout == torch.strided]
    before = [t.clone() for t in dense_dst]
    full = r"^kvoff\.copy_blocks: " + match + r".*dense.*\.to_dense\(\)"
    with pytest.raises(ValueError, match=full):
        if call == "wrapper":
            copy_blocks(args["src"], args["dst"], args["src_ids"], args["dst_ids"])
        elif call == "op":
            torch.ops.kvoff.copy_blocks.default(
                args["src"], args["dst"], args["src_ids"], args["dst_ids"]
            )
        else:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake = {
                k: [mode.from_tensor(t) for t in v] if isinstance(v, list) else mode.from_tensor(v)
                for k, v in args.items()
            }
            with mode:
                torch.ops.kvoff.copy_blocks.default(
                    fake["src"], fake["dst"], fake["src_ids"], fake["dst_ids"]
                )
    assert all(torch.equal(a, b) for a, b in zip(dense_dst, before, strict=True))


def test_prepare_store_output_refuses_lengths_that_differ() -> None:
    """block_ids[i] is the slot of keys_to_store[i]: a missing or extra id was accepted."""
    assert PrepareStoreOutput([b"a", 7], [0, 1]).block_ids == [0, 1]
    assert PrepareStoreOutput([], [], [b"x"]).evicted_keys == [b"x"]
    for keys, ids in (([b"a", b"b"], [0]), ([b"a"], [0, 1]), ([], [3])):
        with pytest.raises(
            ValueError,
            match=rf"len\(keys_to_store\) = {len(keys)} but len\(block_ids\) = {len(ids)}; "
            r"pass one CPU block id \(slot\) per key",
        ):
            PrepareStoreOutput(keys, ids, [b"e"])


def test_step_columns_read_inline_give_what_the_checked_path_gives() -> None:
    """The binding reads a step's ids and ints inline (CPython's compact str and int layouts)
    and keeps the step's records from one call to the next: a non-ASCII id, ints of several
    digits, bools and a request whose column entry changes from blocks to None between steps
    must come out as the checked path reads them."""
    s = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    a = Request("réq-ü", [b"h1", b"h2", b"h3"], 12)  # not ASCII: the checked path
    b = Request("b", [b"g1", b"g2", b"g3"], 12)
    for r in (a, b):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, [], 0)
    # a bool, a negative and a multi-digit id are named in the error; nothing changes
    for bad, error, match in (
        (True, TypeError, r"new_block_ids\[0\]\[0\]\[1\] must be an int, got bool"),
        (-1, ValueError, "-1"),
        (2**40, ValueError, "1099511627776"),
        (2**70, ValueError, "1180591620717411303424"),
    ):
        before = snapshot(s, [], ["réq-ü", "b"])
        with pytest.raises(error, match=match):
            s.build_connector_meta_columns(["réq-ü", "b"], [[[1, bad]], [[3]]], [0, 0], [4, 4])
        assert snapshot(s, [], ["réq-ü", "b"]) == before
    # step 1: blocks for both; step 2: none for the first (its reused record must not keep
    # step 1's blocks), one more for the second
    m1 = s.build_connector_meta_columns(["réq-ü", "b"], [[[1]], [[3]]], [0, 0], [4, 4])
    assert sorted((j.request_id, j.gpu.block_ids) for j in m1.store_jobs) == [
        ("b", (3,)),
        ("réq-ü", (1,)),
    ]
    m2 = s.build_connector_meta_columns(["réq-ü", "b"], [None, [[4]]], [4, 4], [3, 4])
    assert [(j.request_id, j.gpu.block_ids) for j in m2.store_jobs] == [("b", (4,))]
    m3 = s.build_connector_meta_columns(["réq-ü", "b"], [[[2]], None], [7, 8], [1, 3])
    assert [(j.request_id, j.gpu.block_ids) for j in m3.store_jobs] == [("réq-ü", (2,))]


class LazyRequest:
    """An engine request whose ``block_hashes`` property runs ``hook`` once when armed: engine
    code run while a scheduler step pulls the request's new hashes."""

    def __init__(self, rid: str, hashes: list[bytes], num_tokens: int) -> None:
        self.request_id, self._hashes, self.num_tokens = rid, hashes, num_tokens
        self.hook: object = None

    @property
    def block_hashes(self) -> list[bytes]:
        hook, self.hook = self.hook, None
        if callable(hook):
            hook()
        return self._hashes


def test_a_step_run_inside_another_steps_hash_pull_gets_its_own_scratch() -> None:
    """A warm step reuses the calling thread's buffers (records, joined columns, hash views). An
    engine's ``block_hashes`` may be a property (Python code) that steps another scheduler while
    the first one is mid-step: the inner step must get buffers of its own, and both steps must
    give exactly the jobs they give one after the other."""

    def run(nested: bool) -> tuple[list, list]:
        outer = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16).sched
        inner = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16).sched
        a = LazyRequest("a", [b"a1"], 4)
        b = LazyRequest("b", [b"b1"], 4)
        c = LazyRequest("c", [b"c1"], 4)
        for s, r in ((outer, a), (outer, b), (inner, c)):
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)
            s.update_state_after_alloc(r, [], 0)
        # three full blocks each now, but only one hash taken: the step pulls the rest
        for r in (a, b, c):
            r._hashes, r.num_tokens = [r._hashes[0], r.request_id.encode() + b"2",
                                       r.request_id.encode() + b"3"], 12  # fmt: skip
        results: dict[str, list] = {}

        def step_inner() -> None:
            meta = inner.build_connector_meta_columns(["c"], [[[7, 8, 9]]], [0], [12])
            results["inner"] = [(j.request_id, j.gpu.block_ids, j.keys) for j in meta.store_jobs]

        if nested:
            b.hook = step_inner  # runs while the outer step reads b's hashes
        meta = outer.build_connector_meta_columns(["a", "b"], [[[1, 2, 3]], [[4, 5, 6]]],
                                                  [0, 0], [12, 12])  # fmt: skip
        if not nested:
            step_inner()
        assert "inner" in results and b.hook is None  # the hook ran (inside, when nested)
        outer_jobs = [(j.request_id, j.gpu.block_ids, j.keys) for j in meta.store_jobs]
        return outer_jobs, results["inner"]

    nested, sequential = run(True), run(False)
    assert nested == sequential
    outer_jobs, inner_jobs = nested
    assert sorted((rid, ids) for rid, ids, _ in outer_jobs) == [("a", (1, 2, 3)), ("b", (4, 5, 6))]
    assert [(rid, ids) for rid, ids, _ in inner_jobs] == [("c", (7, 8, 9))]
    assert all(len(keys) == 3 for _, _, keys in outer_jobs + inner_jobs)


def test_a_call_back_into_the_same_scheduler_from_its_hash_pull_is_refused() -> None:
    """A step holds pointers to its requests' records while it pulls block hashes from the
    engine's request objects. Engine code run there (a ``block_hashes`` property) that calls
    the same scheduler back could erase a record or hand it to a new request, and the step
    would then store one request's GPU blocks under another's keys (wrong KV served later; it
    did, before the guard: ``a``'s blocks 1-3 stored as ``z``'s). Every changing call is
    refused there with a RuntimeError that changes nothing, and the step goes on as if no call
    had been made; a refusal the engine code does not catch ends the step, changing nothing."""

    def setup() -> tuple[EngineSim, list[LazyRequest], LazyRequest]:
        sim = EngineSim(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32)
        a, b = LazyRequest("a", [b"a1"], 4), LazyRequest("b", [b"b1"], 4)
        for r in (a, b):
            assert sim.sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sim.sched.update_state_after_alloc(r, [], 0)
            # three full blocks now, one hash taken: the step pulls the rest (b's runs the hook)
            r._hashes, r.num_tokens = [r._hashes[0], r.request_id.encode() + b"2",
                                       r.request_id.encode() + b"3"], 12  # fmt: skip
        return sim, [a, b], LazyRequest("z", [b"z1", b"z2", b"z3"], 12)

    def step(sim: EngineSim) -> list[tuple]:
        meta = sim.sched.build_connector_meta_columns(["a", "b"], [[[1, 2, 3]], [[4, 5, 6]]],
                                                      [0, 0], [12, 12])  # fmt: skip
        return [(j.request_id, j.gpu.block_ids, j.keys) for j in meta.store_jobs]

    sim, _, _ = setup()
    expected = step(sim)
    assert sorted((rid, ids) for rid, ids, _ in expected) == [("a", (1, 2, 3)), ("b", (4, 5, 6))]
    assert all(keys[0].startswith(rid.encode()) for rid, _, keys in expected)

    sim, (a, b), z = setup()
    s = sim.sched
    calls = {
        "request_finished": lambda: s.request_finished(a),
        "get_num_new_matched_tokens": lambda: s.get_num_new_matched_tokens(z, 0),
        "update_state_after_alloc": lambda: s.update_state_after_alloc(a, [], 0),
        "build_connector_meta": lambda: s.build_connector_meta_columns(["a"], [None], [0], [12]),
        "update_connector_output": lambda: s.update_connector_output([]),
        "take_events": s.take_events,
        "reset_cache": s.reset_cache,
    }
    refused: dict[str, str] = {}

    def call_back() -> None:
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match="inside this scheduler's own") as e:
                call()
            refused[name] = str(e.value)

    b.hook = call_back
    assert step(sim) == expected  # the step went on as if no call had been made
    assert set(refused) == set(calls)
    assert all(msg.startswith(name + ":") for name, msg in refused.items())
    assert "a" in s._requests and s.stats()["num_requests"] == 2  # a's finish changed nothing
    # after the step the same calls work
    assert s.request_finished(a) is True and "a" not in s._requests

    # uncaught, the refusal ends the outer step, which changes nothing but the hashes taken
    sim, (a, b), z = setup()
    s = sim.sched
    before = snapshot(s, [b"a1\0", b"b1\0"], ["a", "b"])
    b.hook = lambda: s.request_finished(a)
    with pytest.raises(RuntimeError, match="request_finished: called from inside"):
        step(sim)
    assert snapshot(s, [b"a1\0", b"b1\0"], ["a", "b"]) == before
    assert step(sim) == expected  # and the engine's next try gives the same jobs


def test_fast_hooks_refuse_bad_calls_as_the_pybind11_methods_do() -> None:
    """The per-step hooks are also plain CPython methods (``_FastHooks``, what
    ``OffloadingScheduler`` calls). Their argument checks and their translation of C++
    exceptions are their own code: each error path here is also taken through the pybind11
    method of the same name, and a refused call changes nothing."""
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8)
    s = sim.sched
    fast, core = s._hooks, s._core
    assert type(fast).__name__ == "_FastHooks"
    r = Request("x", [b"h1", b"h2"], 9)
    for hooks in (fast, core):
        # a C++ std::invalid_argument becomes a ValueError; the request it registered is gone
        with pytest.raises(ValueError, match="num_computed_tokens 3"):
            hooks.sync_and_match(r, 3, s._requests)
        with pytest.raises(ValueError, match="block id 999"):
            hooks.sync_and_alloc(r, [[1, 999]], 0, s._requests)
        assert s.stats()["num_requests"] == 0 and s._requests == {}
        with pytest.raises(TypeError, match="counts must be a dict"):
            hooks.update_connector_output_counts([(1, 1)])
        with pytest.raises(ValueError, match="reports more ranks than world_size"):
            hooks.update_connector_output_counts({0: [5, 0]})
        with pytest.raises(TypeError, match="seen must be None or a tuple"):
            hooks.counters_delta([0])
        with pytest.raises(ValueError, match=r"'x'\): unknown request; pass the request"):
            hooks.build_connector_meta(
                ["x"], [None], [0], [1], (), (), (), (), s._requests,
                False, True, None,
            )  # fmt: skip
    # positional arguments only, in the number the method takes; bools are bools
    with pytest.raises(TypeError, match="sync_and_match takes 3 positional arguments, got 2"):
        fast.sync_and_match(r, 0)
    with pytest.raises(TypeError, match="takes no keyword arguments"):
        fast.sync_and_alloc(r, [], 0, requests=s._requests)
    empty = ((), (), (), (), (), (), (), (), s._requests)
    for hooks in (fast, core):  # pybind11 alone would take 1 (and None) as a bool
        with pytest.raises(TypeError, match=r"with_keys must be a bool \(True or False\), got int"):
            hooks.build_connector_meta(*empty, 1, True, None)
        with pytest.raises(TypeError, match=r"packed must be a bool .*, got NoneType"):
            hooks.build_connector_meta(*empty, True, None, None)
    with pytest.raises(TypeError, match="num_computed_tokens must be an int, got float"):
        fast.sync_and_match(r, 0.0, s._requests)
    with pytest.raises(TypeError, match="request_id must be a str"):
        fast.request_finished(5, None)
    with pytest.raises(TypeError, match="request_finished takes 2 positional arguments, got 1"):
        fast.request_finished("y")
    assert s.stats()["num_requests"] == 0 and s.stats()["lookups"] == 0
    # an int-like object with __index__ is taken as pybind11 takes it
    assert fast.sync_and_match(r, np.int64(0), s._requests) == core.sync_and_match(
        Request("y", [b"h1", b"h2"], 9), 0, s._requests
    )


def test_fast_hooks_keep_their_scheduler_alive_and_cannot_be_made_empty() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8)
    sim.add_request("a", list(range(9)))
    sim.step()
    hooks = sim.sched._core.fast_hooks()
    del sim
    gc.collect()
    # the scheduler the hooks hold is the one the engine drove (its counters), still alive
    delta, _ = hooks.counters_delta(None)
    assert delta["lookups"] == 1 and delta["store_jobs"] == 1
    assert hooks.request_finished("a", None) == 0  # no job in flight, no store due
    assert hooks.request_finished("a", None) == 0  # now unknown
    assert isinstance(hooks.take_events(), list)
    with pytest.raises(TypeError, match="cannot create"):
        type(hooks)()
