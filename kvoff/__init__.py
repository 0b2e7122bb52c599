"""kvoff: KV-cache offloading for LLM inference engines.

kvoff keeps a large pool of paged KV-cache blocks in (pinned) CPU memory, keyed by prefix block
hashes, stores newly computed blocks GPU→CPU in the background and loads cached prefixes back
CPU→GPU so that an engine skips their prefill.

Parts:
  * ``torch.ops.kvoff.*`` (module ``kvoff._C``): batched multi-layer block copies.
  * ``kvoff._scheduler`` (pybind11 over the C++ core): the CPU block pool, the
    offloading manager (``CPUOffloadingManager``) and the per-step scheduler behind
    ``OffloadingScheduler`` (the engine-facing hooks).
  * Python: KV cache specs, the offloading configuration, the worker and the CLI.
"""

from __future__ import annotations

from kvoff._version_check import TorchVersionMismatchError as _TorchVersionMismatchError
from kvoff._version_check import check_torch_version as _check_torch_version

try:
    _check_torch_version()
except _TorchVersionMismatchError:
    from kvoff.tools.info import invoked_as_kvoff_info as _invoked_as_kvoff_info

    if not _invoked_as_kvoff_info():
        raise
    # `kvoff info` exists to diagnose this mismatch: report it (without loading the compiled
    # extensions, which would not load under this torch) instead of dying of it.
    from kvoff.tools.info import report_without_extensions as _report

    raise SystemExit(_report()) from None

# Order matters: the torch ops library must be loaded before the fake kernels register.
from kvoff import _C  # noqa: F401  (registers torch.ops.kvoff.*)
from kvoff._build_info import VERSION as _VERSION
from kvoff._scheduler import (
    CPUOffloadingManager,
    OffloadingEvent,
    PrepareStoreOutput,
)
from kvoff.config import OffloadingConfig
from kvoff.kv_cache_config import get_kv_cache_config, pool_bytes_per_block
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.ops import copy_blocks
from kvoff.scheduler import (
    ConnectorMetadata,
    ConnectorOutput,
    FinishState,
    JobReport,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    SchedulerStep,
    TransferJob,
)
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvoff.tools.info import BuildInfo, build_info
from kvoff.worker import (
    CPUBlockSpec,
    GPUBlockSpec,
    OffloadingWorker,
    TransferResult,
)

#: kvoff's version with its wheel's local label: "0.1.0+cpu", "0.1.0+cu130" (see build_info()).
__version__: str = _VERSION

__all__ = [
    "BuildInfo",
    "CPUBlockSpec",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "ConnectorMetadata",
    "ConnectorOutput",
    "FinishState",
    "FullAttentionSpec",
    "GPUBlockSpec",
    "JobReport",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingScheduler",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "Request",
    "ScheduledRequest",
    "SchedulerStep",
    "SlidingWindowSpec",
    "TransferJob",
    "TransferResult",
    "UniformTypeKVCacheSpecs",
    "__version__",
    "build_info",
    "copy_blocks",
    "get_kv_cache_config",
    "pool_bytes_per_block",
]
