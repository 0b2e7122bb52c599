"""``auto`` calibrated on the GPU it runs on (kvoff.calibration, kvoff.chunk_sweep), with CPU
tensors and a real temporary cache folder: the order thresholds come from, the cache key, the
cache file (round trip, corrupt, stale, unwritable folder), the background calibration (swaps
only once done) and the probe's time bound. The GPU probe itself runs on GPU machines."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoff import calibration
from kvoff.calibration import (
    CACHE_DIR_ENV,
    AutoThresholds,
    CalibrationKey,
    cache_dir,
    cache_path,
    read_cached,
    resolve_auto_thresholds,
    worker_thresholds,
    write_cached,
)
from kvoff.chunk_sweep import SweepTimeout, derive_thresholds, measure_chunk_sweep
from kvoff.transfer import (
    CALIBRATED_FOR,
    COPY_MECHANISMS,
    FORMAT_VERSION,
    THRESHOLDS_ENV,
    TransferThresholds,
    default_thresholds,
    load_thresholds,
)
from kvoff.worker import OffloadingWorker

KEY = CalibrationKey("Test GPU 80GB", "9.0", "580.1.2", "13.0", "block_contiguous")


def _thresholds(source: str, gbps: float = 40.0) -> TransferThresholds:
    """Deterministic thresholds (two chunk sizes), told apart by ``source``."""
    sweep = [
        {"chunk_bytes": c, **{f"{d}_{m}_gbps": gbps * k for d in ("store", "load")
                              for m in ("memcpy", "batch", "kernel")}}
        for c, k in ((4096, 0.25), (2 << 20, 1.0))
    ]  # fmt: skip
    slow = {d: dict.fromkeys(COPY_MECHANISMS, 0.01) for d in ("store", "load")}
    return derive_thresholds(sweep, slow, {"store": 0.9, "load": 0.9}, source)


class _Probe:
    """A deterministic probe: records its calls, optionally waits for ``release``."""

    def __init__(self, result: TransferThresholds | None = None, *, block: bool = False) -> None:
        self.result = result or _thresholds("probe")
        self.calls: list[tuple[CalibrationKey, float]] = []
        self.release = threading.Event()
        if not block:
            self.release.set()

    def __call__(self, key: CalibrationKey, deadline: float) -> TransferThresholds:
        self.calls.append((key, deadline))
        assert self.release.wait(10)
        return self.result


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.delenv(THRESHOLDS_ENV, raising=False)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    default_thresholds.cache_clear()
    yield
    default_thresholds.cache_clear()


def _packaged() -> TransferThresholds:
    """The packaged thresholds (the fixture has cleared ``$KVOFF_TRANSFER_THRESHOLDS``)."""
    return load_thresholds()


# ----------------------------------------------------------------------------- order


def test_explicit_then_environment_then_cache_then_packaged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_cached(KEY, _thresholds("cached"))
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps(_thresholds("environment").to_json()))
    explicit_file = tmp_path / "explicit.json"
    explicit_file.write_text(json.dumps(_thresholds("explicit file").to_json()))
    monkeypatch.setenv(THRESHOLDS_ENV, str(env_file))
    probe = _Probe()

    explicit = _thresholds("explicit")
    auto = resolve_auto_thresholds(KEY, explicit=explicit, probe=probe)
    assert (auto.origin, auto.current()) == ("explicit", explicit)
    auto = resolve_auto_thresholds(KEY, explicit=explicit_file, probe=probe)
    assert (auto.origin, auto.current().source) == ("explicit", "explicit file")

    auto = resolve_auto_thresholds(KEY, probe=probe)
    assert (auto.origin, auto.current().source) == ("environment", "environment")

    monkeypatch.delenv(THRESHOLDS_ENV)
    default_thresholds.cache_clear()
    auto = resolve_auto_thresholds(KEY, probe=probe)
    assert (auto.origin, auto.current().source) == ("cache", "cached")
    assert auto.done

    cache_path(KEY).unlink()
    auto = resolve_auto_thresholds(KEY, probe=probe, start=False)
    assert auto.origin == "packaged" and not auto.done
    assert auto.current() == _packaged()
    assert probe.calls == []  # nothing before that: explicit, environment and cache won


def test_no_key_means_no_probe() -> None:
    probe = _Probe()
    auto = resolve_auto_thresholds(None, probe=probe)
    assert auto.done and auto.origin == "packaged" and auto.current() == _packaged()
    assert not auto.calibrate() and probe.calls == []


def test_a_cpu_worker_runs_no_probe() -> None:
    """The CPU path does not use the thresholds: no calibration, nothing cached."""
    auto = worker_thresholds(torch.device("cpu"), "layer_major")
    assert auto.done and auto.probe is None
    w = OffloadingWorker(8, 4)
    w.register_kv_caches({"l0": torch.zeros(8, 2, 16, dtype=torch.uint8)})
    assert w._auto is None
    assert not cache_dir().exists()
    w.close()


# ----------------------------------------------------------------------------- key and folder


def test_the_cache_key_names_gpu_driver_runtime_layout_and_format() -> None:
    assert KEY.to_json() == {
        "gpu_name": "Test GPU 80GB",
        "compute_capability": "9.0",
        "driver": "580.1.2",
        "cuda_runtime": "13.0",
        "gpu_layout": "block_contiguous",
        "format": FORMAT_VERSION,
    }
    other_layout = CalibrationKey("Test GPU 80GB", "9.0", "580.1.2", "13.0", "layer_major")
    new_driver = CalibrationKey("Test GPU 80GB", "9.0", "590.0", "13.0", "block_contiguous")
    assert KEY.file_name() != other_layout.file_name()
    assert KEY.file_name() == new_driver.file_name()  # measured again in place: stale
    assert "block_contiguous" in KEY.file_name() and KEY.file_name().endswith(".json")
    with pytest.raises(ValueError, match="gpu_layout"):
        CalibrationKey("g", "9.0", "d", "r", "kv_first")


def test_the_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The calibrations and the tools' tiny models share one cache folder, found the same way
    (the tiny models ignored XDG_CACHE_HOME)."""
    from kvoff.tools.tiny_models import models_dir

    assert cache_dir() == tmp_path / "cache" / "calibration"
    assert models_dir() == tmp_path / "cache" / "models"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvoff" / "calibration"
    assert models_dir() == tmp_path / "xdg" / "kvoff" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvoff" / "calibration"
    assert models_dir() == tmp_path / "home" / ".cache" / "kvoff" / "models"


# ----------------------------------------------------------------------------- cache file


def test_write_then_read_round_trip() -> None:
    t = _thresholds("round trip")
    path = write_cached(KEY, t)
    assert path == cache_path(KEY) and path.is_file()
    assert os.listdir(path.parent) == [path.name]  # the temporary file was renamed
    assert json.loads(path.read_text())[CALIBRATED_FOR] == KEY.to_json()
    assert read_cached(KEY) == t
    assert load_thresholds(path) == t  # the format load_thresholds reads


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", "\xff\xfe"],
    ids=["not-json", "not-an-object", "not-utf8"],
)
def test_a_corrupt_file_warns_and_falls_back(content: str) -> None:
    path = cache_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("latin-1"))
    with pytest.warns(UserWarning, match=f"{path.name}.*measures again"):
        assert read_cached(KEY) is None
    with pytest.warns(UserWarning, match=path.name):
        auto = resolve_auto_thresholds(KEY, probe=_Probe(), start=False)
    assert auto.origin == "packaged" and auto.current() == _packaged()


def test_invalid_thresholds_warn_and_fall_back() -> None:
    doc = {**_thresholds("x").to_json(), CALIBRATED_FOR: KEY.to_json()}
    del doc["store"]["gbps"]["kernel"]
    path = cache_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=f"{path.name} is invalid"):
        assert read_cached(KEY) is None


@pytest.mark.parametrize("field", ["driver", "format"])
def test_a_stale_file_warns_and_falls_back(field: str) -> None:
    write_cached(KEY, _thresholds("old"))
    path = cache_path(KEY)
    doc = json.loads(path.read_text())
    if field == "driver":
        doc[CALIBRATED_FOR]["driver"] = "550.0"
    else:
        doc["format"] = FORMAT_VERSION - 1
        doc[CALIBRATED_FOR]["format"] = FORMAT_VERSION - 1
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=f"{path.name} is stale") as record:
        assert read_cached(KEY) is None
    assert len(record) == 1
    probe = _Probe()
    with pytest.warns(UserWarning, match="stale"):
        auto = resolve_auto_thresholds(KEY, probe=probe, start=False)
    assert auto.current() == _packaged()
    assert auto.calibrate() and read_cached(KEY) == probe.result  # measured again, in place


def test_an_unwritable_folder_warns(tmp_path: Path) -> None:
    # a regular file where a folder should be: no folder can be made under it, even as root
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    folder = blocker / "calibration"
    with pytest.warns(UserWarning, match=f"cannot write .*{KEY.file_name()}.*{CACHE_DIR_ENV}"):
        assert write_cached(KEY, _thresholds("x"), folder) is None
    probe = _Probe()
    auto = resolve_auto_thresholds(KEY, probe=probe, folder=folder, start=False)
    with pytest.warns(UserWarning, match="cannot write"):
        assert auto.calibrate()
    assert auto.current() == probe.result  # used by this process all the same


# ----------------------------------------------------------------------------- background


def test_the_background_calibration_swaps_only_once_done() -> None:
    probe = _Probe(block=True)
    auto = resolve_auto_thresholds(KEY, probe=probe)  # started in a thread
    for _ in range(200):
        if probe.calls:
            break
        time.sleep(0.01)
    assert len(probe.calls) == 1 and probe.calls[0][0] == KEY
    assert not auto.done
    assert auto.current() == _packaged() and auto.origin == "packaged"
    assert not cache_path(KEY).exists()
    probe.release.set()
    assert auto.wait(10)
    assert auto.current() == probe.result and auto.origin == "calibrated"
    assert read_cached(KEY) == probe.result
    again = _Probe()
    later = resolve_auto_thresholds(KEY, probe=again)
    assert later.origin == "cache" and later.current() == probe.result and again.calls == []


def test_the_probe_gets_a_deadline_within_its_budget() -> None:
    probe = _Probe()
    auto = AutoThresholds(KEY, probe=probe, budget_s=1.5)
    before = time.monotonic()
    assert auto.calibrate()
    ((_, deadline),) = probe.calls
    assert before < deadline <= before + 1.5
    assert auto.probe_seconds is not None and auto.probe_seconds < 1.5


def test_a_probe_past_its_budget_changes_nothing() -> None:
    def slow(key: CalibrationKey, deadline: float) -> TransferThresholds:
        time.sleep(0.2)
        return _thresholds("too late")

    auto = AutoThresholds(KEY, probe=slow, budget_s=0.05)
    with pytest.warns(UserWarning, match="did not finish within 0.05 s"):
        assert not auto.calibrate()
    assert auto.done and auto.current() == _packaged() and not cache_path(KEY).exists()


@pytest.mark.parametrize("error", [SweepTimeout("late"), RuntimeError("CUDA out of memory")])
def test_a_probe_that_raises_changes_nothing(error: Exception) -> None:
    def failing(key: CalibrationKey, deadline: float) -> TransferThresholds:
        raise error

    auto = AutoThresholds(KEY, probe=failing)
    with pytest.warns(UserWarning, match="keeps the packaged thresholds"):
        assert not auto.calibrate()
    assert auto.done and auto.current() == _packaged() and not cache_path(KEY).exists()


# ----------------------------------------------------------------------------- measurement


def test_the_sweep_measures_every_size_direction_and_mechanism_on_cpu() -> None:
    rows = measure_chunk_sweep(torch.device("cpu"), (64, 1024), total_bytes=1 << 14, repeat=1)
    assert [r["chunk_bytes"] for r in rows] == [64, 1024]
    for r in rows:
        for d in ("store", "load"):
            for m in ("memcpy", "batch", "kernel"):
                assert r[f"{d}_{m}_gbps"] > 0
    derive_thresholds(rows, {d: dict.fromkeys(COPY_MECHANISMS, 0.0) for d in ("store", "load")},
                      {"store": 1.0, "load": 1.0}, "cpu")  # fmt: skip


def test_the_sweep_stops_at_its_deadline() -> None:
    with pytest.raises(SweepTimeout):
        measure_chunk_sweep(torch.device("cpu"), (64,), total_bytes=1 << 12,
                            deadline=time.monotonic() - 1)  # fmt: skip


def test_the_bench_and_the_library_share_the_measurement() -> None:
    from kvoff.tools import bench_transfer

    assert bench_transfer.derive_thresholds is derive_thresholds
    assert calibration.PROBE_CHUNK_BYTES[0] == bench_transfer.SWEEP_CHUNK_BYTES[0]
    assert calibration.PROBE_CHUNK_BYTES[-1] == bench_transfer.SWEEP_CHUNK_BYTES[-1]
