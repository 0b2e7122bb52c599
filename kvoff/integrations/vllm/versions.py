"""The vLLM releases kvoff's integration is tested with, and what it does on the others.

kvoff meets vLLM at two interfaces that vLLM changes between releases: ``KVConnectorBase_V1``
(:class:`~kvoff.integrations.vllm.KvoffConnector`) and the ``OffloadingConnector``'s spec,
manager and worker classes (:class:`~kvoff.integrations.vllm.KvoffOffloadingSpec`). On a release
outside :data:`VLLM_TESTED_VERSIONS` both warn once when they start. The spec path refuses at
start a vLLM whose ``OffloadingWorker`` is handed resolved device pointers instead of GPU block
specs (vLLM 0.34.0's ``submit_store(job_id, device_ptrs, dst_spec)``): kvoff's worker copies
by GPU block id, and a worker fed pointers would fail every transfer of a running engine.
"""

from __future__ import annotations

import inspect
import logging

from kvoff._optional import VLLM_TESTED_VERSIONS, vllm_release_tested

__all__ = ["VLLM_TESTED_VERSIONS", "check_offloading_worker_interface", "warn_if_untested"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()  # the integrations warned about in this process


def vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``; ``"unknown"`` when it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def warn_if_untested(integration: str) -> bool:
    """Logs one warning per process and ``integration`` (``"KvoffConnector"``,
    ``"KvoffOffloadingSpec"``) when the installed vLLM is not a release in
    :data:`VLLM_TESTED_VERSIONS` (:func:`kvoff._optional.vllm_release_tested`: a local label
    such as ``+cu130`` is a build of the same release).

    Returns:
        True when it warned now.
    """
    version = vllm_version()
    if vllm_release_tested(version) or integration in _warned:
        return False
    _warned.add(integration)
    logger.warning(
        "kvoff: %s is tested with vLLM %s, and this is vLLM %s: it starts, but vLLM's "
        "connector interfaces change between releases; install one of those to be sure",
        integration, " / ".join(VLLM_TESTED_VERSIONS), version,
    )  # fmt: skip
    return True


def check_offloading_worker_interface(worker_class: type | None = None) -> None:
    """Refuses a vLLM whose ``OffloadingWorker.submit_store`` takes something other than a
    GPU block spec (``src_spec``) as kvoff's worker does (vLLM 0.32 and 0.33).

    Args:
        worker_class: vLLM's ``OffloadingWorker`` (default: the installed one,
            ``vllm.v1.kv_offload.base.OffloadingWorker``).

    Raises:
        RuntimeError: ``submit_store``'s parameters are not ``(self, job_id, src_spec,
            dst_spec)`` (vLLM 0.34.0 hands workers ``device_ptrs``); the message names the
            vLLM version and the two ways on: :class:`KvoffConnector`, or a tested vLLM.
    """
    if worker_class is None:
        from vllm.v1.kv_offload.base import OffloadingWorker as worker_class
    params = list(inspect.signature(worker_class.submit_store).parameters)
    if params[1:3] == ["job_id", "src_spec"]:
        return
    raise RuntimeError(
        f"KvoffOffloadingSpec implements the OffloadingConnector worker interface of vLLM "
        f"{' / '.join(VLLM_TESTED_VERSIONS)}, where submit_store(job_id, src_spec, dst_spec) is "
        f"given GPU block ids; this vLLM {vllm_version()} calls submit_store"
        f"({', '.join(params[1:])}). Use kvoff's own connector instead (kv_connector="
        f'"KvoffConnector", kv_connector_module_path="kvoff.integrations.vllm"), or install '
        f"vllm=={VLLM_TESTED_VERSIONS[-1]}"
    )
