"""The node pool's successor map: which key was stored or touched after which (a request's chain,
head to tail), so that a one-key look-up answers the keys that follow (``LOOKUP_AHEAD``) and a
miss asks the tiers for the whole run (:mod:`kvoff.node_pool.server`). It is a hint: a wrong
successor costs one more look-up, never a wrong answer.

**On disk.** With a disk tier, the blocks outlive the pool, and without the map a new pool
promotes each chain a key at a time, a step per key. So a pool with a disk tier writes the map
next to the tier when it stops cleanly and reads it back when it starts.

The file (``successors.kvoff``), little-endian: ``MAGIC`` (8 bytes), ``version u32``, then
two key lists in the node pool protocol's encoding (:func:`kvoff.node_pool.protocol.encode_keys`:
the keys, then their successors, pairwise), then an xxh3_64 of everything before it. It is
written to a temporary file and renamed into place, so a reader sees a whole file or the old
one. The map is a hint (a wrong successor costs one more look-up, never a wrong answer), so a
file that is missing, of another version, truncated or corrupt is ignored with a warning.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import xxhash

from kvoff.node_pool import protocol as p

__all__ = ["FILE_NAME", "MAGIC", "VERSION", "SuccessorMap", "load_successors", "save_successors"]

logger = logging.getLogger(__name__)

FILE_NAME = "successors.kvoff"
"""The map's file name in the disk tier's folder."""
MAGIC = b"KVOFFSUC"
VERSION = 1


def save_successors(path: str | os.PathLike[str], successors: dict[bytes, bytes]) -> None:
    """Writes ``successors`` (oldest first, as the pool keeps them) to ``path`` atomically.

    Raises:
        OSError: the folder cannot be written (the old file, if any, stays).
    """
    body = (
        MAGIC
        + struct.pack("<I", VERSION)
        + p.encode_keys(list(successors))
        + p.encode_keys(list(successors.values()))
    )
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_successors(path: str | os.PathLike[str], limit: int) -> dict[bytes, bytes]:
    """The map saved at ``path``, its newest ``limit`` entries at most; empty (with a warning
    for anything but a missing file) when the file is missing, unreadable, of another version,
    truncated or corrupt."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        logger.warning("kvoff node pool: cannot read the successor map %s (%s); ignored", path, e)
        return {}
    why = None
    if len(data) < len(MAGIC) + 12 or not data.startswith(MAGIC):
        why = "not a successor map"
    elif struct.unpack_from("<I", data, len(MAGIC))[0] != VERSION:
        why = f"version {struct.unpack_from('<I', data, len(MAGIC))[0]}, not {VERSION}"
    elif struct.unpack_from("<Q", data, len(data) - 8)[0] != xxhash.xxh3_64_intdigest(data[:-8]):
        why = "checksum mismatch (corrupt or torn)"
    if why is None:
        try:
            keys, off = p.decode_keys(data, len(MAGIC) + 4)
            values, off = p.decode_keys(data, off)
        except p.ProtocolError as e:
            why = f"bad key lists ({e})"
        else:
            if off != len(data) - 8 or len(keys) != len(values):
                why = "bad key lists (lengths)"
    if why is not None:
        logger.warning("kvoff node pool: the successor map %s is ignored: %s", path, why)
        return {}
    pairs = list(zip(keys, values, strict=True))[-limit:] if limit > 0 else []
    return dict(pairs)


class SuccessorMap:
    """key -> the key stored or touched after it, the oldest dropped first beyond ``capacity``
    entries (insertion-ordered).

    Args:
        capacity: entries kept at most (the server's ``SUCCESSORS_PER_SLOT`` x slots).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.next: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.next)

    def record(self, keys: list[bytes]) -> None:
        """Records that each key was followed by the next (a request's chain, head to tail)."""
        succ = self.next
        # one C call (a repeated key maps to itself, where walk stops; vLLM's chained block
        # hashes never repeat)
        succ.update(itertools.pairwise(keys))
        cap = self.capacity
        if len(succ) > cap:
            # the oldest eighth goes at once: a dict's next(iter()) walks over the slots that
            # earlier deletions left, so one oldest key at a time cost 2.3 µs per key stored
            # once the map was full (with tiers, evictions do not shrink it)
            for k in list(itertools.islice(succ, len(succ) - cap + cap // 8)):
                del succ[k]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drops the keys' entries (evicted, or stores that failed)."""
        succ = self.next
        for k in keys:
            succ.pop(k, None)

    def walk(self, key: bytes, limit: int) -> list[bytes]:
        """``key`` and the keys that followed it, ``limit`` keys at most (a cycle stops it)."""
        chain, seen, succ = [key], {key}, self.next
        while len(chain) < limit and (nxt := succ.get(chain[-1])) is not None and nxt not in seen:
            chain.append(nxt)
            seen.add(nxt)
        return chain

    def save(self, path: str | os.PathLike[str]) -> None:
        """:func:`save_successors` of this map.

        Raises:
            OSError: as :func:`save_successors`.
        """
        save_successors(path, self.next)

    def load(self, path: str | os.PathLike[str]) -> int:
        """Replaces the map with the one saved at ``path`` (:func:`load_successors`; its newest
        ``capacity`` entries); returns the entries read (0 for a missing or bad file)."""
        self.next = load_successors(path, self.capacity)
        return len(self.next)
