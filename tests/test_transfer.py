"""Choosing a copy mechanism (kvoff.transfer), the exact-size pinned pool (kvoff.pinned) and
``kvoff bench transfer`` (CPU mode; the GPU mode runs on GPU machines). No timing assertions."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvoff.pinned import HostPool, PinningError, _Registrar
from kvoff.tools.bench_transfer import (
    TRANSFER_PRESETS,
    TransferBenchParams,
    derive_thresholds,
    run_transfer_bench,
)
from kvoff.tools.cli import main
from kvoff.transfer import (
    THRESHOLDS_ENV,
    DirectionThresholds,
    TransferThresholds,
    choose_mechanism,
    default_thresholds,
    load_thresholds,
)

# ------------------------------------------------------------------------------ thresholds

_SIZES = (4096, 32768, 262144, 2097152)


def _direction(kernel_slowdown: float = 0.8, staged_eff: float = 0.9) -> DirectionThresholds:
    return DirectionThresholds(
        chunk_bytes=_SIZES,
        gbps={
            "memcpy": (1.5, 11.0, 37.0, 49.5),
            "batch": (8.0, 23.0, 50.0, 50.0),
            "kernel": (37.0, 49.0, 52.0, 52.0),
        },
        gemm_slowdown={"memcpy": 0.01, "batch": 0.01, "kernel": kernel_slowdown, "staged": 0.015},
        staged_efficiency=staged_eff,
    )


_T = TransferThresholds(store=_direction(), load=_direction(), min_chunks_for_kernel=4,
                        source="test")  # fmt: skip


@pytest.mark.parametrize(
    ("chunk", "chunks", "staged", "batch", "budget", "expected"),
    [
        # small chunks of a layer-major cache: staging is the fastest within 3 %
        (32768, 64, 2 << 20, True, 0.03, "staged"),
        # without the budget the SM kernel wins on bandwidth
        (32768, 64, 2 << 20, True, 1.0, "kernel"),
        # no staging possible (block-contiguous group): copy engines, batched
        (32768, 64, None, True, 0.03, "batch"),
        (32768, 64, None, False, 0.03, "memcpy"),  # no batch API
        # whole 2 MiB blocks: copy engines at the ceiling, staging would only cost a pass
        (2 << 20, 64, 2 << 20, True, 0.03, "batch"),
        # a tiny budget nothing meets: the least costly mechanism
        (32768, 64, 2 << 20, True, 0.0, "batch"),
        (8 << 10, 3, None, True, 1.0, "batch"),  # too few chunks for a kernel launch
        (0, 0, None, True, 0.03, "batch"),
    ],
)
def test_choose_mechanism_by_bandwidth_within_the_budget(
    chunk, chunks, staged, batch, budget, expected
) -> None:
    choice = choose_mechanism(
        chunk, chunks, "store", _T, batch_supported=batch, budget=budget, staged_chunk_bytes=staged
    )
    assert choice.mechanism == expected
    assert choice.within_budget == (choice.gemm_slowdown <= budget)


def test_estimates_interpolate_on_a_log_scale_and_clamp() -> None:
    d = _direction()
    assert d.estimate_gbps("memcpy", 32768) == 11.0
    assert d.estimate_gbps("memcpy", 1024) == 1.5  # below the first size
    assert d.estimate_gbps("memcpy", 1 << 30) == 49.5  # beyond the last
    mid = d.estimate_gbps("memcpy", 92682)  # 2^16.5: halfway between 32 KiB and 256 KiB in log2
    assert 11.0 < mid < 37.0 and abs(mid - (11.0 + (37.0 - 11.0) * 1.5 / 3)) < 0.05
    choice = choose_mechanism(32768, 64, "store", _T, staged_chunk_bytes=2 << 20)
    assert choice.gbps == pytest.approx(0.9 * 50.0)  # staged: efficiency × copy-engine DMA


def test_choose_mechanism_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="direction must be 'store' or 'load', got 'up'"):
        choose_mechanism(1, 8, "up", _T)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        choose_mechanism(-1, 8, "store", _T)
    with pytest.raises(ValueError, match=r"budget=-0\.1 must be >= 0"):
        choose_mechanism(1, 8, "store", _T, budget=-0.1)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite and non-negative"):
            choose_mechanism(bad, 8, "store", _T)
        with pytest.raises(ValueError, match="must be finite and non-negative"):
            choose_mechanism(1, bad, "store", _T)
        with pytest.raises(ValueError, match=r"staged_chunk_bytes \(\w+\) must be finite"):
            choose_mechanism(1, 8, "store", _T, staged_chunk_bytes=bad)


def test_packaged_thresholds_are_the_h100_measurement(monkeypatch) -> None:
    monkeypatch.delenv(THRESHOLDS_ENV, raising=False)
    t = load_thresholds()
    assert "H100" in t.source and "kvoff bench transfer --sweep" in t.source
    # the measured costs: the SM kernel slows compute far beyond the default 3 % budget,
    # copy engines and staging do not
    assert t.store.gemm_slowdown["kernel"] > 0.5
    assert max(t.store.gemm_slowdown[m] for m in ("memcpy", "batch", "staged")) < 0.03
    # so auto never picks the kernel within the default budget, for any chunk size
    for chunk in (4096, 32768, 1 << 20):
        for d in ("store", "load"):
            assert choose_mechanism(chunk, 4096, d, t).mechanism != "kernel"
    assert default_thresholds() == default_thresholds()


def test_thresholds_file_override_and_round_trip(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_T.to_json()))
    assert load_thresholds(path) == _T
    monkeypatch.setenv(THRESHOLDS_ENV, str(path))
    assert load_thresholds() == _T


def test_bad_thresholds_files_name_the_file_and_field(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=r"cannot read transfer thresholds from .*nope\.json"):
        load_thresholds(missing)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"bad\.json is not UTF-8 text"):
        load_thresholds(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_thresholds(bad)
    old = {"store": {"kernel_below_bytes": 1}, "load": {}, "source": "old"}
    bad.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old format .*--write-thresholds"):
        load_thresholds(bad)
    cases = [
        (("store", "chunk_bytes"), [4096, 4096, 8192, 1 << 20], "strictly ascending"),
        (("store", "gbps", "memcpy"), [1.0, 2.0], "needs 4 positive values"),
        (("load", "gemm_slowdown", "kernel"), -0.5, "must be a finite value >= 0"),
        (("load", "staged_efficiency"), 1.5, "staged_efficiency"),
        (("format",), 1, "format=1 is not 2"),
        (("extra_field",), 1, "extra_field"),
    ]
    for path_keys, value, message in cases:
        doc = _T.to_json()
        node = doc
        for key in path_keys[:-1]:
            node = node[key]
        node[path_keys[-1]] = value
        bad.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=message):
            load_thresholds(bad)
    doc = _T.to_json()
    del doc["store"]["gbps"]["batch"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"gbps has curves for \['kernel', 'memcpy'\]"):
        load_thresholds(bad)


def test_derive_thresholds_from_a_sweep_and_measured_costs() -> None:
    sizes = [4096 << k for k in range(4)]
    sweep = []
    for s in reversed(sizes):  # any order
        row = {"chunk_bytes": s}
        for d in ("store", "load"):
            row[f"{d}_kernel_gbps"] = 30.0
            row[f"{d}_batch_gbps"] = 10.0 + s / 4096
            row[f"{d}_memcpy_gbps"] = s / 4096
        sweep.append(row)
    slow = {d: {"memcpy": 0.01, "batch": -0.002, "kernel": 0.7, "staged": 0.02}
            for d in ("store", "load")}  # fmt: skip
    t = derive_thresholds(sweep, slow, {"store": 0.93, "load": 1.2}, "synthetic")
    assert t.store.chunk_bytes == tuple(sizes)
    assert t.store.gbps["memcpy"] == (1.0, 2.0, 4.0, 8.0)
    assert t.store.gemm_slowdown["batch"] == 0.0  # measured noise below zero is clamped
    assert t.load.staged_efficiency == 1.0  # clamped into (0, 1]
    assert t.source == "synthetic"
    assert load_thresholds  # the result validates like a file would
    with pytest.raises(ValueError, match="sweep is empty"):
        derive_thresholds([], slow, {"store": 1, "load": 1}, "x")
    with pytest.raises(ValueError, match="slowdowns of \\['staged'\\]"):
        derive_thresholds(sweep, {d: {"memcpy": 0, "batch": 0, "kernel": 0} for d in slow},
                          {"store": 1, "load": 1}, "x")  # fmt: skip


# ------------------------------------------------------------------------------ pinned pool


class _FakeCuda:
    """Records cudaHostRegister/Unregister calls; refuses the call numbered `fail_at`."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at

    def registrar(self) -> _Registrar:
        def register(address: int, size: int, flags: int) -> int:
            self.calls += 1
            assert flags == 3  # portable | mapped
            if self.calls - 1 == self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            assert address not in self.registered
            self.registered[address] = size
            return 0

        def unregister(address: int) -> int:
            del self.registered[address]
            return 0

        return _Registrar(register, unregister, lambda code: f"fake error {code}")


def test_host_pool_is_exact_and_registers_once() -> None:
    """One cudaHostRegister call over the whole pool: the copy engines refuse a host range that
    spans two registrations (kvoff/pinned.py), so a block or a run of blocks must never cross
    one."""
    fake = _FakeCuda()
    rows = [(5, 1000), (3, 4096)]  # 5000 bytes, then a page-aligned 12288
    pool = HostPool(rows, pin=True, _registrar=fake.registrar())
    assert pool.num_bytes == 8192 + 12288  # 5000 rounded to the next page, no power of two
    assert [t.shape for t in pool.tensors] == [(5, 1000), (3, 4096)]
    assert pool.tensors[1].data_ptr() - pool.tensors[0].data_ptr() == 8192
    base = pool.tensors[0].data_ptr()
    assert base % 4096 == 0  # page-aligned in the address space, not only within the pool
    assert fake.calls == 1 and len(fake.registered) == 1
    _assert_registration_covers_storages(fake, pool.tensors)
    assert pool.pinned
    pool.tensors[1][2] = 7  # the views are ordinary writable memory
    assert int(pool.tensors[1][2].sum()) == 7 * 4096
    pool.close()
    assert fake.registered == {} and not pool.pinned
    pool.close()  # idempotent


def _assert_registration_covers_storages(fake: _FakeCuda, tensors: list[torch.Tensor]) -> None:
    """The one registered range holds every tensor's bytes *and its storage's first byte*:
    torch's ``Tensor.is_pinned()`` asks CUDA about the storage pointer, so a range that starts
    at the aligned data (one page of alignment, or a shared pool's header, before it) made every
    tensor of a pinned pool read as unpinned and kvoff.copy_blocks refused every GPU copy (H200,
    2026-11-26)."""
    ((start, size),) = fake.registered.items()
    for t in tensors:
        storage = t.untyped_storage()
        assert start <= storage.data_ptr() < start + size, "is_pinned() would be False"
        assert start <= t.data_ptr() and t.data_ptr() + t.numel() <= start + size
        assert storage.data_ptr() + storage.nbytes() <= start + size


def test_shared_host_pool_registers_its_header_page_too() -> None:
    fake = _FakeCuda()
    name = f"kvoff-test-pin-{os.getpid()}"
    pool = HostPool([(3, 4096), (2, 100)], pin=True, shared_name=name, _registrar=fake.registrar())
    try:
        assert fake.calls == 1
        _assert_registration_covers_storages(fake, pool.tensors)
    finally:
        pool.close()
    assert fake.registered == {}


def test_host_pool_unregisters_when_garbage_collected() -> None:
    fake = _FakeCuda()
    pool = HostPool([(4, 4096)], pin=True, _registrar=fake.registrar())
    assert len(fake.registered) == 1
    del pool
    assert fake.registered == {}


def test_pinning_failure_names_size_and_fix_and_leaves_nothing_registered() -> None:
    fake = _FakeCuda(fail_at=0)
    with pytest.raises(PinningError) as info:
        HostPool(
            [(10, 4096)],
            pin=True,
            description="the CPU pool (10 CPU blocks of 4096 bytes over 1 tensors)",
            _registrar=fake.registrar(),
        )
    msg = str(info.value)
    assert "pinning the CPU pool (10 CPU blocks of 4096 bytes" in msg
    # the whole allocation: the pool and the page of alignment in front of it
    assert "45056 bytes" in msg and "were refused: fake error 2" in msg
    assert "num_cpu_blocks" in msg and "ulimit -l" in msg
    assert fake.registered == {}


def test_host_pool_without_pinning_and_pinning_without_cuda() -> None:
    pool = HostPool([(2, 16)], pin=False)
    assert not pool.pinned and pool.num_bytes == 32
    for _ in range(20):  # torch's allocator gives 64-byte alignment; the pool gives pages
        pool = HostPool([(3, 65536), (1, 100), (2, 8192)], pin=False)
        assert all(t.data_ptr() % 4096 == 0 for t in pool.tensors)
    if not torch.cuda.is_available():
        with pytest.raises(PinningError, match=r"needs CUDA.*use pin_memory=False"):
            HostPool([(2, 16)], pin=True)
    with pytest.raises(ValueError, match="non-negative"):
        HostPool([(-1, 16)], pin=False)


# ------------------------------------------------------------------------------ bench


def test_presets_describe_their_chunks() -> None:
    llama = TRANSFER_PRESETS["llama-3-8b"]
    assert llama.chunk_bytes == 16 * 8 * 128 * 2  # 32 KiB K or V chunk of a 16-token block
    assert llama.bytes_per_block == 32 * 2 * 32768
    assert {p.chunk_bytes for p in TRANSFER_PRESETS.values()} >= {4096, 8192}  # small GQA
    assert TRANSFER_PRESETS["deepseek-v3-mla"].chunk_bytes == 64 * 576 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode")
def test_cli_cpu_mode_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--presets", "qwen2.5-0.5b", "--blocks", "16", "--repeat", "2",
            "--job-sizes", "1", "4", "--step-jobs", "5"]  # fmt: skip
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b (layer_major)" in out and "qwen2.5-0.5b (block_contiguous)" in out
    assert "one contiguous memcpy" in out and "job of   4 blocks" in out
    assert "a step's 5 one-block jobs, one by one / together: store" in out
    doc = json.loads(path.read_text())
    assert doc["run"]["command"] == "kvoff " + " ".join([*argv, "--json", str(path)])
    assert doc["device"]["kind"] == "cpu"
    block_contiguous, layer_major = doc["presets"]
    assert layer_major["gpu_layout"] == "layer_major"
    assert block_contiguous["gpu_layout"] == "block_contiguous"
    for entry, mechanisms in ((layer_major, {"per_block", "memcpy", "batch", "kernel", "staged",
                                             "auto"}),
                              (block_contiguous, {"per_block", "memcpy", "batch", "kernel",
                                                  "auto"})):  # fmt: skip
        assert entry["num_blocks"] == 16
        assert entry["bytes_per_job"] == 16 * 24 * 2 * 4096
        assert entry["contiguous"]["memcpy_gbps"] > 0
        assert set(entry["mechanisms"]) == mechanisms
        for row in entry["mechanisms"].values():
            assert row["store_gbps"] > 0 and row["load_gbps"] > 0 and row["store_vs_memcpy"] > 0
            assert "gemm_slowdown" not in row  # GPU only
        assert [js["blocks"] for js in entry["job_sizes"]] == [1, 4]
        assert all(js["store_us"] > 0 and js["store_time_vs_contiguous"] > 0
                   for js in entry["job_sizes"])  # fmt: skip
        sj = entry["step_jobs"]
        assert sj["jobs"] == 5 and sj["bytes_per_job"] == 24 * 2 * 4096
        for d in ("store", "load"):
            assert sj[f"{d}_one_by_one_us"] > 0 and sj[f"{d}_together_us"] > 0
            assert sj[f"{d}_together_speedup"] == sj[f"{d}_one_by_one_us"] / sj[f"{d}_together_us"]
    assert doc["targets"]["layer_major_auto_both_vs_contiguous"] == 0.9
    assert doc["complete"] is True
    assert not path.with_name(path.name + ".tmp").exists()


def test_json_is_written_after_every_layout_so_a_cut_run_keeps_its_results(tmp_path) -> None:
    """A lent GPU's time limit can kill a long run: what was measured is already on disk."""
    path = tmp_path / "partial.json"
    seen: list[tuple[bool, int] | None] = []

    def log(msg: str) -> None:  # called before each preset and layout is measured
        if not path.exists():
            seen.append(None)
            return
        d = json.loads(path.read_text())
        seen.append((d["complete"], len(d["presets"])))

    params = TransferBenchParams(
        presets=("qwen2.5-0.5b",), num_blocks=8, repeat=1, warmup=0, job_sizes=(1,)
    )
    doc = run_transfer_bench(params, json_path=path, log=log, device=torch.device("cpu"))
    assert seen == [None, (False, 1)]  # nothing before the first layout, one after it
    assert doc["complete"] is True and json.loads(path.read_text()) == json.loads(json.dumps(doc))


def test_write_thresholds_needs_a_gpu_sweep(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="needs a GPU, --sweep"):
        run_transfer_bench(
            TransferBenchParams(presets=("qwen2.5-0.5b",), num_blocks=8),
            write_thresholds=tmp_path / "t.json",
        )
    with pytest.raises(ValueError, match="unknown transfer preset 'nope'"):
        run_transfer_bench(TransferBenchParams(presets=("nope",)))
    with pytest.raises(ValueError, match="unknown GPU layout 'diagonal'"):
        run_transfer_bench(TransferBenchParams(layouts=("diagonal",)))
