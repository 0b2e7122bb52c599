"""``mechanism="auto"`` calibrated on the GPU it runs on, cached per GPU and layout.

The packaged thresholds (``kvoff/data/transfer_thresholds.json``) are one H100's measurement; on
another GPU they choose worse (on an H200 ``auto`` reached 0.88 of a contiguous copy where
``batch`` reached 0.98). So the worker resolves what ``auto`` decides from, in this order:

1. an explicit file or object: the ``transfer_thresholds`` option, the worker's ``thresholds=``;
2. ``$KVOFF_TRANSFER_THRESHOLDS`` (:data:`kvoff.transfer.THRESHOLDS_ENV`);
3. a calibration cached for this GPU: one JSON file per GPU model, compute capability and GPU
   layout in :func:`cache_dir`, holding the thresholds (the format :func:`kvoff.transfer.
   load_thresholds` reads) and, under :data:`kvoff.transfer.CALIBRATED_FOR`, the
   :class:`CalibrationKey` they were measured for (model, compute capability, driver, CUDA
   runtime, layout, format version);
4. the packaged file, while a short probe (:func:`gpu_probe`: a few chunk sizes per direction
   through :func:`kvoff.chunk_sweep.measure_chunk_sweep`, at most :data:`DEFAULT_PROBE_SECONDS`)
   runs in a background thread started when the worker registers its CUDA caches. When it
   finishes in time its thresholds are cached and used for every later job.

A cache file that is not JSON, is invalid, or was measured for another key (a new driver or
CUDA runtime, another format version) is ignored with one warning naming the file, and measured
again; a cache folder that cannot be written is a warning too (the calibration is then used for
this process only). Nothing here raises into the engine. On CPU there is nothing to calibrate:
the CPU op does not use the thresholds.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from kvoff.chunk_sweep import SweepTimeout, derive_thresholds, measure_chunk_sweep
from kvoff.ops import batch_copy_supported
from kvoff.transfer import (
    CALIBRATED_FOR,
    COPY_MECHANISMS,
    FORMAT_VERSION,
    THRESHOLDS_ENV,
    TransferThresholds,
    default_thresholds,
    load_thresholds,
    thresholds_from_json,
)

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_PROBE_SECONDS",
    "PROBE_CHUNK_BYTES",
    "AutoThresholds",
    "CalibrationKey",
    "Probe",
    "cache_dir",
    "cache_path",
    "device_key",
    "gpu_probe",
    "read_cached",
    "resolve_auto_thresholds",
    "worker_thresholds",
    "write_cached",
]

CACHE_DIR_ENV = "KVOFF_CACHE_DIR"
"""Environment variable naming kvoff's cache folder (else ``$XDG_CACHE_HOME/kvoff``, else
``~/.cache/kvoff``); calibrations go to its ``calibration/`` folder."""

DEFAULT_PROBE_SECONDS = 2.0
"""Time budget of the first-use probe (seconds of wall time, in its background thread)."""

PROBE_CHUNK_BYTES: tuple[int, ...] = (4096, 32768, 262144, 2 << 20)
"""Chunk sizes the probe measures (the full sweep of ``kvoff bench transfer --sweep`` has ten):
the ends and two points between, enough for the log2 interpolation of
:meth:`kvoff.transfer.DirectionThresholds.estimate_gbps`."""

PROBE_JOB_BYTES = 16 << 20
"""Bytes per timed job of the probe (the full sweep uses 256 MiB): 32 MiB of GPU memory per chunk
size at a time, since the engine holds most of it."""

_PROBE_STOP_SHARE = 0.8
"""The probe is asked to start no measurement after this share of its budget: one that started
before may end after it, and a result returned after the whole budget is discarded."""

Probe = Callable[["CalibrationKey", float], TransferThresholds]
"""A measurement: ``probe(key, deadline)`` returns thresholds for ``key``, starting no work after
``deadline`` (a ``time.monotonic()`` value; :class:`kvoff.chunk_sweep.SweepTimeout` when it
cannot finish). A parameter, so CPU tests give a deterministic one."""


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration was measured for; a cached one is used only for an equal key.

    Attributes:
        gpu_name: the device's name (``torch.cuda.get_device_properties(d).name``).
        compute_capability: ``"major.minor"``, e.g. ``"9.0"``.
        driver: the NVIDIA driver version (``"580.159.04"``; ``"cuda-driver-12080"`` when only
            the CUDA driver API version is known; ``"unknown"``).
        cuda_runtime: the CUDA runtime torch was built with (``torch.version.cuda``).
        gpu_layout: ``"block_contiguous"`` or ``"layer_major"`` (the worker's: layer-major when
            any group is).
        format: the thresholds file format version (:data:`kvoff.transfer.FORMAT_VERSION`).

    Raises:
        ValueError: for another layout.
    """

    gpu_name: str
    compute_capability: str
    driver: str
    cuda_runtime: str
    gpu_layout: str
    format: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.gpu_layout not in ("block_contiguous", "layer_major"):
            raise ValueError(
                f"gpu_layout={self.gpu_layout!r} is not 'block_contiguous' or 'layer_major'"
            )

    def to_json(self) -> dict[str, object]:
        """The key as the JSON object stored under :data:`kvoff.transfer.CALIBRATED_FOR`."""
        return asdict(self)

    def file_name(self) -> str:
        """The cache file's name: GPU model, compute capability and layout (a new driver, CUDA
        runtime or format makes the file stale and it is measured again, in place)."""
        model = re.sub(r"[^a-z0-9]+", "-", self.gpu_name.lower()).strip("-")[:48] or "gpu"
        digest = hashlib.sha256(self.gpu_name.encode()).hexdigest()[:8]
        cc = self.compute_capability.replace(".", "")
        return f"transfer-{model}-{digest}-sm{cc}-{self.gpu_layout}.json"


def _driver_version() -> str:
    """The NVIDIA driver version, read without a subprocess (this runs at registration)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    if m:
        return m.group(1)
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda-driver-{version.value}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def device_key(device: torch.device, gpu_layout: str) -> CalibrationKey:
    """The key of CUDA ``device`` for a worker of ``gpu_layout``.

    Raises:
        ValueError: when ``device`` is not a CUDA device, or for an unknown layout.
    """
    if device.type != "cuda":
        raise ValueError(f"only CUDA devices are calibrated, got {device}")
    props = torch.cuda.get_device_properties(device)
    return CalibrationKey(
        gpu_name=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        driver=_driver_version(),
        cuda_runtime=str(torch.version.cuda),
        gpu_layout=gpu_layout,
    )


def cache_root() -> Path:
    """kvoff's cache folder: ``$KVOFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoff``, else
    ``~/.cache/kvoff`` (the XDG Base Directory Specification's user cache; not created). The
    calibrations are in its ``calibration/`` (:func:`cache_dir`), the tools' tiny models in its
    ``models/`` (:func:`kvoff.tools.tiny_models.models_dir`)."""
    base = os.environ.get(CACHE_DIR_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "kvoff") if xdg else str(Path.home() / ".cache" / "kvoff")
    return Path(base).expanduser()


def cache_dir() -> Path:
    """The folder of calibration files: ``calibration/`` in :func:`cache_root`
    (``$KVOFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoff``, else ``~/.cache/kvoff``; not
    created)."""
    return cache_root() / "calibration"


def cache_path(key: CalibrationKey, folder: Path | None = None) -> Path:
    """Where the calibration of ``key`` is cached (``folder`` default: :func:`cache_dir`)."""
    return (cache_dir() if folder is None else Path(folder)) / key.file_name()


def read_cached(key: CalibrationKey, folder: Path | None = None) -> TransferThresholds | None:
    """The cached calibration of ``key``, or None when there is none or it cannot be used.

    A file that is not UTF-8 JSON, does not hold valid thresholds, or was measured for another
    key (driver, CUDA runtime, format) gives one ``UserWarning`` naming the file; never raises.
    """
    path = cache_path(key, folder)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no calibration yet (a bad folder: on write)
        return None
    except (OSError, UnicodeDecodeError) as exc:
        _warn(f"cannot read the calibration cache file {path} ({exc}); {_FIX}")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        _warn(f"the calibration cache file {path} is not valid JSON ({exc}); {_FIX}")
        return None
    if not isinstance(data, dict):
        _warn(f"the calibration cache file {path} is not a JSON object; {_FIX}")
        return None
    measured_for = data.get(CALIBRATED_FOR)
    if measured_for != key.to_json() or data.get("format") != FORMAT_VERSION:
        _warn(
            f"the calibration cache file {path} is stale: measured for {measured_for} (format "
            f"{data.get('format')}), this is {key.to_json()}; {_FIX}"
        )
        return None
    try:
        return thresholds_from_json(data, str(path))
    except ValueError as exc:
        _warn(f"the calibration cache file {path} is invalid ({exc}); {_FIX}")
        return None


_FIX = (
    "it is ignored and kvoff measures again (delete the file to silence this; set "
    f"{THRESHOLDS_ENV} to use a file of your own)"
)


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def write_cached(
    key: CalibrationKey, thresholds: TransferThresholds, folder: Path | None = None
) -> Path | None:
    """Cache ``thresholds`` for ``key`` atomically (a temporary file in the same folder, then a
    rename: a reader never sees half a file). Returns the path, or None with one
    ``UserWarning`` when the folder cannot be written; never raises."""
    path = cache_path(key, folder)
    doc = {**thresholds.to_json(), CALIBRATED_FOR: key.to_json()}
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        _warn(
            f"cannot write the calibration cache file {path} ({exc.strerror or exc}); the "
            f"calibration is used by this process only: set {CACHE_DIR_ENV} to a writable folder"
        )
        return None
    return path


def gpu_probe(device: torch.device) -> Probe:
    """The first-use probe of CUDA ``device``: GB/s of ``memcpy``, ``batch`` and ``kernel`` per
    direction at :data:`PROBE_CHUNK_BYTES` (jobs of :data:`PROBE_JOB_BYTES`, 3 timed after 1
    warm-up, on a stream of its own). A short probe cannot measure a GEMM's slowdown to 3 %, so
    ``gemm_slowdown`` and ``staged_efficiency`` are the packaged file's (properties of copy
    engines against SM copies more than of one GPU; ``kvoff bench transfer --sweep
    --write-thresholds`` measures them too). Where ``cudaMemcpyBatchAsync`` is unsupported,
    ``batch`` gets ``memcpy``'s curve (``auto`` does not consider it there)."""

    def probe(key: CalibrationKey, deadline: float) -> TransferThresholds:
        batch = batch_copy_supported()
        mechanisms = ("memcpy", "batch", "kernel") if batch else ("memcpy", "kernel")
        with torch.cuda.device(device):
            rows = measure_chunk_sweep(
                device, PROBE_CHUNK_BYTES, total_bytes=PROBE_JOB_BYTES, repeat=3, warmup=1,
                mechanisms=mechanisms, deadline=deadline,
            )  # fmt: skip
        if not batch:
            for row in rows:
                for d in ("store", "load"):
                    row[f"{d}_batch_gbps"] = row[f"{d}_memcpy_gbps"]
        packaged = _packaged_thresholds()
        slow = {
            d: {m: packaged.for_direction(d).gemm_slowdown[m] for m in COPY_MECHANISMS}
            for d in ("store", "load")
        }
        eff = {d: packaged.for_direction(d).staged_efficiency for d in ("store", "load")}
        date = datetime.date.today().isoformat()
        source = (
            f"calibrated on {key.gpu_name} (sm {key.compute_capability}, CUDA "
            f"{key.cuda_runtime}, driver {key.driver}, {key.gpu_layout}) by kvoff's first-use "
            f"probe on {date}: GB/s of {len(PROBE_CHUNK_BYTES)} chunk sizes measured; "
            "gemm_slowdown and staged_efficiency from the packaged file"
        )
        return derive_thresholds(rows, slow, eff, source)

    return probe


def _packaged_thresholds() -> TransferThresholds:
    """The packaged thresholds, whatever ``$KVOFF_TRANSFER_THRESHOLDS`` says (read directly:
    this runs in the probe's thread, which must not touch the environment)."""
    where = "the packaged kvoff/data/transfer_thresholds.json"
    text = resources.files("kvoff").joinpath("data/transfer_thresholds.json").read_text()
    return thresholds_from_json(json.loads(text), where)


class AutoThresholds:
    """What ``auto`` decides from for a worker: fixed thresholds, or the fallback until a
    background calibration succeeds (then its result, for every later :meth:`current`).

    Args:
        key: what a calibration is measured for (None: nothing to calibrate).
        fixed: thresholds to use as they are (None: :func:`kvoff.transfer.default_thresholds`,
            read at first use, until a calibration succeeds).
        origin: where :meth:`current`'s answer comes from: ``"explicit"``, ``"environment"``,
            ``"cache"``, ``"packaged"``; ``"calibrated"`` once a probe succeeded.
        probe: the measurement (None: no calibration).
        folder: the cache folder (default :func:`cache_dir`).
        budget_s: the probe's time budget in seconds (> 0).

    Raises:
        ValueError: for a budget <= 0.
    """

    def __init__(
        self,
        key: CalibrationKey | None,
        *,
        fixed: TransferThresholds | None = None,
        origin: str = "packaged",
        probe: Probe | None = None,
        folder: Path | None = None,
        budget_s: float = DEFAULT_PROBE_SECONDS,
    ) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s={budget_s} must be > 0 (seconds)")
        self.key = key
        self.origin = origin
        self.probe = probe if key is not None else None
        self.folder = folder
        self.budget_s = float(budget_s)
        self.probe_seconds: float | None = None
        self._thresholds = fixed
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        if self.probe is None:
            self._done.set()

    def current(self) -> TransferThresholds:
        """The thresholds for the next job (a plain attribute read: no lock on the job path).

        Raises:
            ValueError: when the fallback file (``$KVOFF_TRANSFER_THRESHOLDS``) cannot be read.
        """
        return self._thresholds if self._thresholds is not None else default_thresholds()

    @property
    def done(self) -> bool:
        """Whether no calibration is pending (none was needed, or it ended either way)."""
        return self._done.is_set()

    def start(self) -> None:
        """Run :meth:`calibrate` in a daemon thread (once; a no-op without a probe)."""
        if self.probe is None or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self.calibrate, name="kvoff-calibration", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the calibration ended (or ``timeout`` seconds); returns :attr:`done`."""
        return self._done.wait(timeout)

    def calibrate(self) -> bool:
        """Run the probe within the budget; on success cache its thresholds and use them.

        A probe that raises, or returns after ``budget_s``, changes nothing (one
        ``UserWarning``); never raises. Returns whether the thresholds were swapped.
        """
        if self.probe is None or self.key is None:
            return False
        try:
            start = time.monotonic()
            try:
                result = self.probe(self.key, start + _PROBE_STOP_SHARE * self.budget_s)
            except SweepTimeout:
                result = None
            except Exception as exc:  # a failed probe must never reach the engine
                _warn(
                    f"kvoff's calibration of auto on {self.key.gpu_name} failed ({exc!r}); auto "
                    f"keeps the packaged thresholds (measure with `kvoff bench transfer --sweep "
                    f"--write-thresholds FILE` and set {THRESHOLDS_ENV}=FILE)"
                )
                return False
            self.probe_seconds = time.monotonic() - start
            if result is None or self.probe_seconds > self.budget_s:
                _warn(
                    f"kvoff's calibration of auto on {self.key.gpu_name} did not finish within "
                    f"{self.budget_s} s; auto keeps the packaged thresholds (measure with "
                    f"`kvoff bench transfer --sweep --write-thresholds FILE` and set "
                    f"{THRESHOLDS_ENV}=FILE)"
                )
                return False
            write_cached(self.key, result, self.folder)
            self._thresholds = result
            self.origin = "calibrated"
            return True
        finally:
            self._done.set()


def resolve_auto_thresholds(
    key: CalibrationKey | None,
    *,
    explicit: TransferThresholds | str | os.PathLike[str] | None = None,
    probe: Probe | None = None,
    folder: Path | None = None,
    budget_s: float = DEFAULT_PROBE_SECONDS,
    start: bool = True,
) -> AutoThresholds:
    """What ``auto`` decides from, in the module's order: ``explicit`` (thresholds, or a path
    read with :func:`kvoff.transfer.load_thresholds`), ``$KVOFF_TRANSFER_THRESHOLDS``, the
    cached calibration of ``key`` in ``folder``, else the packaged file with ``probe`` started
    in the background (when ``start``; no probe without a key or a probe).

    Raises:
        ValueError: when an explicit path cannot be read or is invalid.
    """
    if explicit is not None:
        fixed = explicit if isinstance(explicit, TransferThresholds) else load_thresholds(explicit)
        return AutoThresholds(key, fixed=fixed, origin="explicit")
    if os.environ.get(THRESHOLDS_ENV):
        return AutoThresholds(key, origin="environment")  # read at first use, as before
    if key is None:
        return AutoThresholds(None)
    cached = read_cached(key, folder)
    if cached is not None:
        return AutoThresholds(key, fixed=cached, origin="cache")
    auto = AutoThresholds(key, probe=probe, folder=folder, budget_s=budget_s)
    if start:
        auto.start()
    return auto


_BY_KEY: dict[CalibrationKey, AutoThresholds] = {}
_BY_KEY_LOCK = threading.Lock()


def worker_thresholds(device: torch.device, gpu_layout: str) -> AutoThresholds:
    """What a worker's ``auto`` decides from on ``device`` (called at registration when no
    thresholds were given): :func:`resolve_auto_thresholds` with :func:`device_key` and
    :func:`gpu_probe` on CUDA, shared by the workers of one process with the same key (one
    probe per GPU model and layout); on CPU, the default thresholds and no probe. Never
    raises for a bad cache (warnings); the environment's file is read at first use."""
    if device.type != "cuda" or os.environ.get(THRESHOLDS_ENV):
        return resolve_auto_thresholds(None)
    key = device_key(device, gpu_layout)
    with _BY_KEY_LOCK:
        auto = _BY_KEY.get(key)
        if auto is None:
            auto = _BY_KEY[key] = resolve_auto_thresholds(key, probe=gpu_probe(device))
    return auto
