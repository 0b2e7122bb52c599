"""``KvoffConnector`` on a node pool (``node_pool`` in ``kv_connector_extra_config``):
:func:`connector_node_pool` connects to ``kvoff pool serve`` and sizes the engine's CPU plan
by the pool's slots. (``KvoffOffloadingSpec``'s way in: ``spec._attach_node_pool``.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoff.integrations.vllm.tier_wiring import tier_fingerprint
from kvoff.integrations.vllm.translate import cpu_spec
from kvoff.offloading_spec import CPUOffloadingSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig

    from kvoff.config import OffloadingConfig
    from kvoff.node_pool import NodePoolClient

__all__ = ["check_fits", "connector_node_pool"]

_PROBE_BYTES = 1 << 62
"""Pool bytes of the spec that only measures an offloaded block's bytes (never allocated)."""


def connector_node_pool(
    vllm_config: VllmConfig,
    kv_cache_config: VllmKVCacheConfig,
    config: OffloadingConfig,
    name: str,
) -> tuple[CPUOffloadingSpec, NodePoolClient]:
    """``KvoffConnector``'s CPU plan on the node pool at ``config.node_pool`` (its slots are
    the plan's CPU blocks) and a connection to it for this engine's layout
    (:func:`tier_fingerprint` of rank 0: the scheduler's keys cover every rank, each rank's
    bytes in its own region of the pool, ``kvoff pool serve --ranks``).

    Args:
        vllm_config, kv_cache_config: the engine's.
        config: ``kv_connector_extra_config`` (``node_pool``: the pool's socket).
        name: how ``kvoff pool status`` names this connection.

    Raises:
        kvoff.node_pool.NodePoolError: no pool answers at the socket.
        ValueError: the pool's slots are not this engine's bytes per offloaded block of one
            rank (naming ``--slot-bytes``), or it serves another number of tensor-parallel
            ranks (naming ``--ranks``); what :func:`.translate.cpu_spec` raises.
    """
    from kvoff.node_pool import NodePoolClient

    path = str(config.node_pool)
    probe = cpu_spec(vllm_config, kv_cache_config, config, cpu_bytes_to_use=_PROBE_BYTES)
    world = probe.world_size
    # an engine: its stores go into reserved slots where they can (no round trip)
    client = NodePoolClient(path, tier_fingerprint(vllm_config, probe, 0), name=name, reserve=True)
    need = probe.bytes_per_offloaded_block
    detail = (f"{probe.kv_bytes_per_block} bytes per GPU block x block_size_factor "
              f"{probe.block_size_factor}")  # fmt: skip
    check_fits(client, world, need, detail)
    spec = cpu_spec(
        vllm_config, kv_cache_config, config, cpu_bytes_to_use=client.num_slots * need * world
    )
    return spec, client


def check_fits(client: NodePoolClient, world: int, need: int, detail: str) -> None:
    """Refuses a node pool that cannot hold this engine's blocks (closing ``client``): another
    number of tensor-parallel ranks than ``world``, or slots of other than ``need`` bytes (one
    rank's offloaded block; ``detail`` says how the engine's figure is made).

    Raises:
        ValueError: naming the ``kvoff pool serve`` option (``--ranks``, ``--slot-bytes``)
            and the value that fits.
    """
    path = client.socket_path
    if len(client.regions) != world:
        client.close()
        raise ValueError(
            f"the node pool at {path} serves {len(client.regions)} tensor-parallel rank(s), but "
            f"this engine has {world}; serve a pool with --ranks {world} for it"
        )
    if client.slot_bytes != need:
        client.close()
        raise ValueError(
            f"the node pool at {path} has slots of {client.slot_bytes} bytes, but this engine's "
            f"offloaded blocks are {need} bytes per rank ({detail}); serve a pool with "
            f"--slot-bytes {need} for this model and layout"
        )
