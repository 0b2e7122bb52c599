"""The node pool: one CPU pool in shared memory, with one index, for every engine on a machine
(``kvoff pool serve``).

:class:`~kvoff.node_pool.server.NodePoolServer` owns the slots (``/dev/shm/<region>``) and the
index (kvoff's C++ manager) and serves batched calls on a Unix socket;
:class:`~kvoff.node_pool.client.NodePoolClient` is an engine's side, with the manager's calls.
Engines map the region and copy to and from its slots directly (pinned on a GPU). See
docs/node-pool.md.
"""

from kvoff.node_pool.client import (
    NodePoolClient,
    NodePoolError,
    NodePoolEvent,
    StoreSlots,
    wait_for_pool,
)
from kvoff.node_pool.server import DEFAULT_REGION, NodePoolServer

__all__ = [
    "DEFAULT_REGION",
    "NodePoolClient",
    "NodePoolError",
    "NodePoolEvent",
    "NodePoolServer",
    "StoreSlots",
    "wait_for_pool",
]
