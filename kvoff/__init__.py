"""kvoff: KV-cache offloading for LLM inference engines.

kvoff keeps a large pool of paged KV-cache blocks in (pinned) CPU memory, keyed by prefix block
hashes, stores newly computed blocks GPU→CPU in the background and loads cached prefixes back
CPU→GPU so that an engine skips their prefill.

Parts:
  * ``torch.ops.kvoff.*`` (module ``kvoff._C``): batched multi-layer block copies.
  * ``kvoff._scheduler`` (pybind11 over the C++ core): the CPU block pool, the
    offloading manager (``CPUOffloadingManager``) and the per-step scheduler behind
    ``OffloadingScheduler`` (the engine-facing hooks).
  * ``kvoff._bench``: the C++ manager benchmark behind ``kvoff bench scheduler``, a module of its
    own so that no benchmark code is in the production modules.
  * Python: KV cache specs, the offloading configuration, the job records (``kvoff.jobs``), the
    worker, and the build report (:func:`build_info`). The command line (``kvoff.tools``) is
    apart: importing the package loads none of it.

``import kvoff`` under a torch the build does not fit raises :class:`ImportError`
(``kvoff._version_check.TorchVersionMismatchError``, naming the fix); it never exits the process.
"""

from __future__ import annotations

from kvoff._version_check import extensions_wanted as _extensions_wanted
from kvoff.install_info import BuildInfo, build_info

# A torch the build does not fit is an ImportError naming the fix (TorchVersionMismatchError),
# raised before any compiled part loads. Only `kvoff info`, which exists to diagnose it, imports
# on without the extensions (they would not load under this torch) and reports.
_WITH_EXTENSIONS = _extensions_wanted()

from kvoff._build_info import VERSION as _VERSION  # noqa: E402  (after the check: it names the fix)

if _WITH_EXTENSIONS:
    # Order matters: the torch ops library must be loaded before the fake kernels register.
    from kvoff import _C  # noqa: F401  (registers torch.ops.kvoff.*)
    from kvoff._scheduler import (
        CPUOffloadingManager,
        OffloadingEvent,
        PrepareStoreOutput,
    )
    from kvoff.config import OffloadingConfig
    from kvoff.jobs import CPUBlockSpec, GPUBlockSpec, TransferResult
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
    from kvoff.worker import OffloadingWorker

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
