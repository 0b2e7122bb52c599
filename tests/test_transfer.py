"""Choosing a copy mechanism (kvoff.transfer), the exact-size pinned pool (kvoff.pinned) and
``kvoff bench transfer`` (CPU mode; the GPU mode runs on GPU machines). No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch

from kvoff.pinned import HostPool, PinningError, _Registrar, chunk_ranges
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

_T = TransferThresholds(
    store=DirectionThresholds(1 << 20, 1 << 20, 1 << 20),
    load=DirectionThresholds(32 << 10, 1 << 20, 256 << 10),
    min_chunks_for_kernel=4,
    source="test",
)


@pytest.mark.parametrize(
    ("chunk", "chunks", "direction", "batch", "expected"),
    [
        (8 << 10, 64, "store", True, "kernel"),
        (4 << 20, 64, "store", True, "memcpy"),
        (8 << 10, 64, "load", True, "kernel"),
        (64 << 10, 64, "load", True, "batch"),  # between the kernel and copy-call ranges
        (64 << 10, 64, "load", False, "kernel"),  # no batch: the kernel range is wider
        (512 << 10, 64, "load", False, "memcpy"),
        (2 << 20, 64, "load", True, "memcpy"),
        (8 << 10, 3, "load", True, "memcpy"),  # too few chunks for a kernel launch
        (0, 0, "store", True, "memcpy"),
    ],
)
def test_choose_mechanism(chunk, chunks, direction, batch, expected) -> None:
    assert choose_mechanism(chunk, chunks, direction, _T, batch_supported=batch) == expected


def test_choose_mechanism_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="direction must be 'store' or 'load', got 'up'"):
        choose_mechanism(1, 8, "up", _T)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        choose_mechanism(-1, 8, "store", _T)


def test_packaged_defaults_load_and_say_where_they_come_from(monkeypatch) -> None:
    monkeypatch.delenv(THRESHOLDS_ENV, raising=False)
    t = load_thresholds()
    assert "unmeasured" in t.source and "kvoff bench transfer" in t.source
    # published numbers: SM reads of host memory are slow, so loads leave the kernel sooner
    assert t.load.kernel_below_bytes < t.store.kernel_below_bytes
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
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_thresholds(bad)
    doc = _T.to_json()
    doc["load"]["batch_below_bytes"] = 1024  # below kernel_below_bytes
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="batch_below_bytes=1024 is below kernel_below_bytes"):
        load_thresholds(bad)
    doc = _T.to_json()
    doc["store"]["kernel_below_bytes"] = -1
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="kernel_below_bytes"):
        load_thresholds(bad)
    doc = _T.to_json()
    doc["extra_field"] = 1
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="extra_field"):
        load_thresholds(bad)


def test_derive_thresholds_finds_the_crossovers() -> None:
    sizes = [4096 << k for k in range(6)]  # 4 KiB .. 128 KiB
    sweep = []
    for s in sizes:
        row = {"chunk_bytes": s}
        for d in ("store", "load"):
            row[f"{d}_kernel_gbps"] = 30.0
            row[f"{d}_batch_gbps"] = 10.0 + s / 4096  # 11, 12, 14, 18, 26, 42
            row[f"{d}_memcpy_gbps"] = s / 4096  # 1, 2, 4, 8, 16, 32
        sweep.append(row)
    sweep[-1]["load_memcpy_gbps"] = 50.0
    t = derive_thresholds(sweep, "synthetic")
    assert t.store.kernel_below_bytes == 128 << 10  # batch 42 >= kernel 30 first at 128 KiB
    assert t.store.batch_below_bytes == 256 << 10  # memcpy never reaches 98 % of batch
    assert t.store.kernel_below_bytes_without_batch == 128 << 10  # 32 >= 30
    assert t.load.batch_below_bytes == 128 << 10  # 50 >= 0.98 * 42
    assert t.source == "synthetic"
    with pytest.raises(ValueError, match="sweep is empty"):
        derive_thresholds([], "x")


# ------------------------------------------------------------------------------ pinned pool


def test_chunk_ranges_cover_exactly() -> None:
    assert chunk_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_ranges(8, 4) == [(0, 4), (4, 4)]
    assert chunk_ranges(0, 4) == []
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        chunk_ranges(8, 0)


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


def test_host_pool_is_exact_and_registers_in_chunks() -> None:
    fake = _FakeCuda()
    rows = [(5, 1000), (3, 4096)]  # 5000 bytes, then a page-aligned 12288
    pool = HostPool(rows, pin=True, chunk_bytes=4096, _registrar=fake.registrar())
    assert pool.num_bytes == 8192 + 12288  # 5000 rounded to the next page, no power of two
    assert [t.shape for t in pool.tensors] == [(5, 1000), (3, 4096)]
    assert pool.tensors[1].data_ptr() - pool.tensors[0].data_ptr() == 8192
    base = pool.tensors[0].data_ptr()
    assert fake.registered == {base + k * 4096: 4096 for k in range(5)}
    assert pool.pinned and pool.num_chunks == 5
    pool.tensors[1][2] = 7  # the views are ordinary writable memory
    assert int(pool.tensors[1][2].sum()) == 7 * 4096
    pool.close()
    assert fake.registered == {} and not pool.pinned
    pool.close()  # idempotent


def test_host_pool_unregisters_when_garbage_collected() -> None:
    fake = _FakeCuda()
    pool = HostPool([(4, 4096)], pin=True, chunk_bytes=8192, _registrar=fake.registrar())
    assert len(fake.registered) == 2
    del pool
    assert fake.registered == {}


def test_pinning_failure_names_size_chunk_and_fix_and_leaves_nothing_registered() -> None:
    fake = _FakeCuda(fail_at=2)
    with pytest.raises(PinningError) as info:
        HostPool(
            [(10, 4096)],
            pin=True,
            chunk_bytes=8192,
            description="the CPU pool (10 CPU blocks of 4096 bytes over 1 tensors)",
            _registrar=fake.registrar(),
        )
    msg = str(info.value)
    assert "pinning the CPU pool (10 CPU blocks of 4096 bytes" in msg
    assert "40960 bytes" in msg and "5 chunk(s)" in msg and "chunk 2 (offset 16384" in msg
    assert "fake error 2" in msg and "num_cpu_blocks" in msg and "ulimit -l" in msg
    assert fake.registered == {}  # the two chunks that succeeded were unregistered


def test_host_pool_without_pinning_and_pinning_without_cuda() -> None:
    pool = HostPool([(2, 16)], pin=False)
    assert not pool.pinned and pool.num_chunks == 0 and pool.num_bytes == 32
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
    argv = ["bench", "transfer", "--presets", "qwen2.5-0.5b", "--blocks", "16", "--repeat", "2"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b" in out and "one contiguous memcpy" in out
    doc = json.loads(path.read_text())
    assert doc["run"]["command"] == "kvoff " + " ".join([*argv, "--json", str(path)])
    assert doc["device"]["kind"] == "cpu"
    (entry,) = doc["presets"]
    assert entry["num_blocks"] == 16
    assert entry["bytes_per_job"] == 16 * 24 * 2 * 4096
    assert entry["contiguous"]["memcpy_gbps"] > 0
    for m in ("per_block", "auto"):
        row = entry["mechanisms"][m]
        assert row["store_gbps"] > 0 and row["load_gbps"] > 0 and row["store_vs_memcpy"] > 0
    assert doc["targets"]["cpu_gather_vs_memcpy"] == 0.8


def test_write_thresholds_needs_a_gpu_sweep(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="needs a GPU and --sweep"):
        run_transfer_bench(
            TransferBenchParams(presets=("qwen2.5-0.5b",), num_blocks=8),
            write_thresholds=tmp_path / "t.json",
        )
    with pytest.raises(ValueError, match="unknown transfer preset 'nope'"):
        run_transfer_bench(TransferBenchParams(presets=("nope",)))
