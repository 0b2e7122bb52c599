"""``bench tiers``: how fast the secondary tiers move blocks, next to what the hardware does.

**Disk** (``disk_path``): for each block size, ``total_bytes`` of blocks (``N = total_bytes //
block_size`` blocks, random payloads from page-aligned buffers, as a page-aligned CPU pool slot
would be) are written through :class:`kvoff.tiers.DiskTier` in batches of ``batch_bytes``
(sequential keys into a fresh tier, so into consecutive slots), then read back and verified by
the tier (header + xxh3 checksum). In the same run and on the same file system, ``dd`` moves the
same bytes with the same block size: ``dd if=/dev/zero of=F bs=B count=N oflag=direct
conv=fsync`` and ``dd if=F of=/dev/null bs=B iflag=direct``. Reported: GB/s of payload (10^9
bytes per second) for the tier and for dd, and their ratio (the issue's target: >= 0.7). The
tier also writes a 4 KiB header per block, which the payload GB/s do not count. The disk is
measured in ``repeat`` passes (each: a fresh folder, dd and the tier side by side, their order
swapped from pass to pass so neither always runs on a warmer disk); the figures are medians over
passes, and each ratio is the median of the passes' own ratios.

**Redis** (``remote_url``, or a local 3-master cluster started for the run when None and
``redis-server`` exists): for each block size, ``min(total_bytes, remote_total_bytes)`` of
blocks are put and then got through :class:`kvoff.tiers.redis_cluster.RedisClusterTier`
(batches of ``batch_bytes``), GB/s of payload; then ``contains`` at ``lookup_batch`` keys per
call (``lookup_rounds`` calls), reported as microseconds per key. Keys are deleted afterwards.

Redis figures are one timed pass (wall clock, ``time.perf_counter``) after a warm-up batch; on a
shared or small machine they are noisy.

**MAC cost** (:func:`bench_mac`, ``shared_secret``): over ``mac_total_bytes`` of random
``mac_block_size`` blocks (default 256 MiB of 512 KiB), in the same run and on the same bytes:
the block MAC (keyed BLAKE3 over header, key and payload,
:func:`kvoff.tiers.block_format.block_mac`), the alternatives (HMAC-SHA256 over the same input,
the MAC of format version 2; the same keyed BLAKE3 with the ``blake3`` package's multithreaded
mode, ``max_threads=AUTO``; keyed BLAKE2b-256 of the payload, Python's stdlib), the xxh3_64
checksum the MAC replaces, and a memcpy (``numpy.copyto``) of each block. ``rounds`` interleaved
rounds; reported: medians of GB/s and of seconds per GB, and each method's time over the MAC's,
the MAC's over the checksum's and over the memcpy's (medians of the rounds' own ratios). With
Redis, :func:`bench_redis_mac` times 512 KiB puts and gets through a tier without and with a
secret, alternated, and reports their ratio (target for gets: >= 0.9), per round (puts then gets)
and for gets in steady state (alternated read passes over blocks stored once).
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvoff.tiers.block_format import (
    HEADER_BYTES,
    MAC_DOMAIN,
    BlockFormat,
    block_mac,
    encode_header,
    layout_fingerprint,
    mac_key,
    mac_message_head,
    payload_checksum,
)
from kvoff.tiers.disk import SUPERBLOCK_BYTES, DiskTier, slot_bytes_for

DEFAULT_BLOCK_SIZES = (65536, 524288, 2097152)
#: Per-pass figures of the disk benchmark reported as medians over passes.
_DISK_MEDIANS = ("write_s", "read_s", "write_gbps", "read_gbps", "dd_write_gbps", "dd_read_gbps",
                 "write_ratio", "read_ratio")  # fmt: skip


def _aligned_blocks(count: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        arr = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        arr[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append(arr)
    return out


def _gbps(nbytes: int, seconds: float) -> float:
    if nbytes == 0:  # nothing moved: no rate, however fast
        return 0.0
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _dd(args: list[str]) -> float:
    """Wall seconds of one dd run (raises CalledProcessError if dd fails)."""
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True, capture_output=True)
    return time.perf_counter() - t0


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def bench_disk(
    path: Path,
    block_size: int,
    total_bytes: int,
    batch_bytes: int,
    io_threads: int,
    repeat: int = 3,
) -> dict[str, Any]:
    """One block size on the disk tier and dd, ``repeat`` passes side by side (module docstring).

    Args:
        path: folder on the file system to measure (a fresh subfolder per pass).
        block_size: payload bytes per block.
        total_bytes: bytes of blocks per pass (``total_bytes // block_size`` blocks, at least 1).
        batch_bytes: bytes of blocks per ``put`` / ``get`` call.
        io_threads: the tier's I/O threads.
        repeat: passes; medians are reported.

    Returns:
        Sizes (bytes, blocks), ``stored`` / ``served`` (blocks, summed over passes), ``write_s``
        / ``read_s`` (median seconds per pass), ``write_gbps``, ``read_gbps``, ``dd_write_gbps``,
        ``dd_read_gbps`` (medians, 10^9 bytes of payload per second), ``write_ratio`` /
        ``read_ratio`` (median of the per-pass tier / dd ratios) and ``passes`` (every pass's
        figures).

    Raises:
        ValueError: ``repeat`` < 1. CalledProcessError: dd failed.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    passes = [
        _disk_pass(path, block_size, total_bytes, batch_bytes, io_threads, dd_first=i % 2 == 0)
        for i in range(repeat)
    ]
    med = lambda name: float(np.median([p[name] for p in passes]))  # noqa: E731
    first = passes[0]
    return {
        "block_size": block_size,
        "blocks": first["blocks"],
        "payload_bytes": first["payload_bytes"],
        "batch_blocks": first["batch_blocks"],
        "repeat": repeat,
        "stored": sum(p["stored"] for p in passes),
        "served": sum(p["served"] for p in passes),
        "direct_io": all(p["direct_io"] for p in passes),
        "failed": _failed(
            sum(p["stored"] for p in passes),
            sum(p["served"] for p in passes),
            first["blocks"] * repeat,
        ),
        **{name: med(name) for name in _DISK_MEDIANS},
        "passes": passes,
    }


def _disk_pass(
    path: Path,
    block_size: int,
    total_bytes: int,
    batch_bytes: int,
    io_threads: int,
    *,
    dd_first: bool,
) -> dict[str, Any]:
    """One pass of :func:`bench_disk`: dd write and read, the tier's writes and reads (in that
    order, or the tier first), in a fresh folder that is removed afterwards."""
    n = max(1, total_bytes // block_size)
    fmt = BlockFormat(layout_fingerprint(bench="tiers", block_size=block_size), block_size)
    batch = max(1, batch_bytes // block_size)
    work = Path(tempfile.mkdtemp(prefix="kvoff-bench-", dir=path))
    try:

        def dd() -> tuple[float, float]:
            dd_file = work / "dd.bin"
            dd_args = ["if=/dev/zero", f"of={dd_file}", f"bs={block_size}", f"count={n}"]
            write = _dd([*dd_args, "oflag=direct", "conv=fsync"])
            read = _dd([f"if={dd_file}", "of=/dev/null", f"bs={block_size}", "iflag=direct"])
            dd_file.unlink()
            return write, read

        def tier_io() -> tuple[int, float, int, float, bool]:
            cap = SUPERBLOCK_BYTES + n * slot_bytes_for(fmt)
            tier = DiskTier(work / "tier", cap, fmt, io_threads=io_threads)
            try:
                keys = [_key(i) for i in range(n)]
                out = _put_then_get(tier, keys, block_size, batch)
                direct = bool(tier.stats()["direct_io"])
            finally:
                tier.close()
            return (*out, direct)

        if dd_first:
            dd_write, dd_read = dd()
            stored, write_s, served, read_s, direct = tier_io()
        else:
            stored, write_s, served, read_s, direct = tier_io()
            dd_write, dd_read = dd()
        payload = n * block_size
        res: dict[str, Any] = {
            "blocks": n,
            "payload_bytes": payload,
            "batch_blocks": batch,
            "dd_first": dd_first,
            "stored": stored,
            "served": served,
            "direct_io": direct,
            "write_s": write_s,
            "read_s": read_s,
            # rates of what the tier really stored and served, not of what it was given
            "write_gbps": _gbps(stored * block_size, write_s),
            "read_gbps": _gbps(served * block_size, read_s),
            "dd_write_gbps": _gbps(payload, dd_write),
            "dd_read_gbps": _gbps(payload, dd_read),
        }
        res["write_ratio"] = res["write_gbps"] / res["dd_write_gbps"]
        res["read_ratio"] = res["read_gbps"] / res["dd_read_gbps"]
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _put_then_get(
    tier: Any, keys: list[bytes], block_size: int, batch: int
) -> tuple[int, float, int, float]:
    """Writes every key (``batch`` per ``put``), then reads every key back (``batch`` per
    ``get``). Returns (blocks stored, put seconds, blocks served, get seconds)."""
    n = len(keys)
    src = _aligned_blocks(min(batch, n), block_size, seed=block_size)
    t0 = time.perf_counter()
    stored = 0
    for start in range(0, n, batch):
        ks = keys[start : start + batch]
        stored += sum(tier.put(ks, [src[j % len(src)] for j in range(len(ks))]))
    put_s = time.perf_counter() - t0
    outs = _aligned_blocks(min(batch, n), block_size, seed=1)
    t0 = time.perf_counter()
    served = 0
    for start in range(0, n, batch):
        ks = keys[start : start + batch]
        served += sum(tier.get(ks, outs[: len(ks)]))
    return stored, put_s, served, time.perf_counter() - t0


def bench_redis(
    url: str,
    block_size: int,
    total_bytes: int,
    batch_bytes: int,
    lookup_batch: int,
    lookup_rounds: int,
) -> dict[str, Any]:
    """One block size on the Redis Cluster tier: put / get GB/s, contains µs per key."""
    from kvoff.tiers.redis_cluster import RedisClusterTier

    n = max(1, total_bytes // block_size)
    fmt = BlockFormat(layout_fingerprint(bench="tiers", block_size=block_size), block_size)
    batch = max(1, batch_bytes // block_size)
    tier = RedisClusterTier(url, fmt, namespace="kvoff-bench", timeout_s=5.0)
    keys = [_key(i) for i in range(n)]
    try:
        warm = _aligned_blocks(min(batch, n), block_size, seed=block_size)
        tier.put(keys[:batch], warm[: len(keys[:batch])])  # warm-up: connections
        stored, put_s, served, get_s = _put_then_get(tier, keys, block_size, batch)
        lookup_keys = [keys[i % n] if i % 2 == 0 else _key(10**9 + i) for i in range(lookup_batch)]
        tier.contains(lookup_keys)
        t0 = time.perf_counter()
        for _ in range(lookup_rounds):
            tier.contains(lookup_keys)
        lookup_s = time.perf_counter() - t0
        stats = tier.stats()
        for start in range(0, n, 1024):
            tier.evict(keys[start : start + 1024])
    finally:
        tier.close()
    failed = _failed(stored, served, n)
    if stored == 0 or served == 0:
        raise ValueError(
            f"the Redis tier at {url} {failed} ({stats['timeouts']} timeouts): is the cluster "
            "up and reachable? check --remote-url, or skip Redis with --no-remote"
        )
    payload = n * block_size
    return {
        "block_size": block_size,
        "blocks": n,
        "payload_bytes": payload,
        "batch_blocks": batch,
        "stored": stored,
        "served": served,
        "failed": failed,
        # rates of what the tier really stored and served, not of what it was given
        "put_gbps": _gbps(stored * block_size, put_s),
        "get_gbps": _gbps(served * block_size, get_s),
        "lookup_batch": lookup_batch,
        "lookup_us_per_key": lookup_s / (lookup_rounds * lookup_batch) * 1e6,
        "timeouts": stats["timeouts"],
        "corrupted_blocks": stats["corrupted_blocks"],
    }


MAC_ALGORITHM = "BLAKE3 keyed_hash (key: BLAKE3 derive_key of the secret)"
"""What :func:`bench_mac` reports as ``mac``: :func:`kvoff.tiers.block_format.block_mac`."""


def _hmac_sha256_mac(secret: bytes, header: Any, key: bytes, payload: Any) -> bytes:
    """The MAC of format version 2 (kvoff before 2026-11-29), for :func:`bench_mac`: HMAC-SHA256
    (RFC 2104) keyed by ``secret`` over the same input as
    :func:`kvoff.tiers.block_format.block_mac` (version 2's domain ``kvoff-block-mac-v1``, the
    header without its MAC field, key length and key, payload)."""
    h = hmac.new(secret, mac_message_head(b"kvoff-block-mac-v1\x00", header, key), "sha256")
    h.update(payload)
    return h.digest()


def _blake3_threads_mac(derived: bytes, header: Any, key: bytes, payload: Any) -> bytes:
    """:func:`kvoff.tiers.block_format.block_mac`'s keyed BLAKE3 with the ``blake3`` package's
    multithreaded mode (``max_threads=blake3.AUTO``: a Rayon pool of one thread per core), for
    :func:`bench_mac`; ``derived``: the 32-byte key,
    :func:`kvoff.tiers.block_format.mac_key`."""
    import blake3

    head = mac_message_head(MAC_DOMAIN, header, key)
    h = blake3.blake3(head, key=derived, max_threads=blake3.blake3.AUTO)
    h.update(payload)
    return bytes(h.digest())


def bench_mac(
    total_bytes: int = 256 << 20, block_size: int = 512 << 10, rounds: int = 3
) -> dict[str, Any]:
    """The cost of the blocks' MAC (``shared_secret``) per GB, next to its alternatives, the
    xxh3_64 checksum it replaces and a memcpy of the same bytes, all in one run (module
    docstring). Every method runs single-threaded on one block at a time, as a tier's thread
    verifies a block, except ``blake3_threads``.

    Args:
        total_bytes: bytes of blocks hashed per method and round (``total_bytes //
            block_size`` blocks, at least one).
        block_size: payload bytes per block.
        rounds: interleaved rounds; every figure is a median over them.

    Returns:
        ``{"block_size", "blocks", "payload_bytes", "header_bytes_hashed_by_mac", "rounds",
        "mac_algorithm", "gbps": {method: GB/s}, "s_per_gb": {method: seconds per 10^9 bytes},
        "over_mac": {method: its time / the MAC's}, "mac_over_checksum", "mac_over_memcpy",
        "blake2b_over_mac", "per_round": [{method: seconds}]}``. Methods: ``mac`` (the block
        MAC, :data:`MAC_ALGORITHM`, header + key + payload), ``hmac_sha256`` (format version
        2's HMAC-SHA256 of the same input), ``blake3_threads`` (``mac`` with
        ``max_threads=AUTO``), ``blake2b`` (keyed BLAKE2b-256 of the payload), ``checksum``
        (xxh3_64 of the payload) and ``memcpy`` (``numpy.copyto``). GB are 10^9 bytes of
        payload.

    Raises:
        ValueError: ``block_size``, ``total_bytes`` or ``rounds`` below 1.
        kvoff._optional.MissingExtraError: the ``blake3`` package is not installed.
    """
    if block_size < 1 or total_bytes < 1 or rounds < 1:
        raise ValueError(
            f"bench_mac needs block_size, total_bytes and rounds >= 1, got {block_size}, "
            f"{total_bytes}, {rounds}"
        )
    n = max(1, total_bytes // block_size)
    data = np.frombuffer(os.urandom(n * block_size), np.uint8)
    blocks = [data[i * block_size : (i + 1) * block_size] for i in range(n)]
    secret = os.urandom(32)
    # a MAC'd format: makes sure blake3 is there, and gives the derived key
    fmt = BlockFormat(
        layout_fingerprint(bench="mac", block_size=block_size), block_size, shared_secret=secret
    )
    header = encode_header(fmt, _key(0), blocks[0])
    derived = mac_key(secret)
    dst = np.empty(block_size, np.uint8)
    methods: dict[str, Any] = {
        "mac": lambda i, b: block_mac(secret, header, _key(i), b),
        "hmac_sha256": lambda i, b: _hmac_sha256_mac(secret, header, _key(i), b),
        "blake3_threads": lambda i, b: _blake3_threads_mac(derived, header, _key(i), b),
        "blake2b": lambda i, b: hashlib.blake2b(b, key=secret, digest_size=32).digest(),
        "checksum": lambda i, b: payload_checksum(b),
        "memcpy": lambda i, b: np.copyto(dst, b),
    }
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        seconds: dict[str, float] = {}
        names = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in names:
            fn = methods[name]
            t0 = time.perf_counter()
            for i, b in enumerate(blocks):
                fn(i, b)
            seconds[name] = time.perf_counter() - t0
        per_round.append(seconds)
    payload = n * block_size
    med = {m: statistics.median(r[m] for r in per_round) for m in methods}
    over_mac = {m: statistics.median(r[m] / r["mac"] for r in per_round) for m in methods}
    return {
        "block_size": block_size,
        "blocks": n,
        "payload_bytes": payload,
        "header_bytes_hashed_by_mac": HEADER_BYTES,
        "rounds": rounds,
        "mac_algorithm": MAC_ALGORITHM,
        "gbps": {m: _gbps(payload, med[m]) for m in methods},
        "s_per_gb": {m: med[m] / payload * 1e9 for m in methods},
        "over_mac": over_mac,
        "mac_over_checksum": statistics.median(r["mac"] / r["checksum"] for r in per_round),
        "mac_over_memcpy": statistics.median(r["mac"] / r["memcpy"] for r in per_round),
        "blake2b_over_mac": over_mac["blake2b"],
        "per_round": per_round,
    }


def bench_redis_mac(
    url: str,
    block_size: int = 512 << 10,
    total_bytes: int = 128 << 20,
    batch_bytes: int = 32 << 20,
    rounds: int = 5,
    steady_passes: int = 12,
) -> dict[str, Any]:
    """Redis tier puts and gets of ``block_size`` blocks without and with a ``shared_secret``
    (the MAC, :data:`MAC_ALGORITHM`), alternated in ``rounds`` rounds (each: a fresh namespace,
    put every block, get every block back verified, evict). GB/s of payload, medians; ratios
    MAC / plain are medians of the rounds' own ratios (target for gets: >= 0.9). With a local
    cluster on a small machine the servers and the client share the cores, so the MAC's CPU
    time comes straight off the throughput; successive runs on the 2-core box differ by about
    0.1 in the gets ratio, hence 5 rounds.

    Then the gets in steady state: both namespaces are filled once and read once (warm-up),
    then read back ``steady_passes`` times each, alternated (plain first in even passes), with
    no puts in between; reported as the median and quartiles of the passes' ratios.

    Returns:
        ``{"block_size", "blocks", "rounds", "mac_algorithm", "plain_put_gbps",
        "plain_get_gbps", "mac_put_gbps", "mac_get_gbps", "put_ratio", "get_ratio",
        "per_round", "steady"}``; ``steady``: ``{"passes", "get_ratio", "get_ratio_q1",
        "get_ratio_q3", "per_pass"}`` (``per_pass``: ``plain_get_gbps``, ``mac_get_gbps``),
        or None when ``steady_passes`` is 0.

    Raises:
        ValueError: a round did not store and serve every block (the message says how many).
    """
    from kvoff.tiers.redis_cluster import RedisClusterTier

    n = max(1, total_bytes // block_size)
    batch = max(1, batch_bytes // block_size)
    keys = [_key(i) for i in range(n)]
    fp = layout_fingerprint(bench="tiers-mac", block_size=block_size)
    secret = os.urandom(32)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        row: dict[str, float] = {}
        order = (None, secret) if r % 2 == 0 else (secret, None)
        for mode in order:
            name = "plain" if mode is None else "mac"
            fmt = BlockFormat(fp, block_size, shared_secret=mode)
            tier = RedisClusterTier(url, fmt, namespace=f"kvoff-bench-{name}", timeout_s=5.0)
            try:
                warm = _aligned_blocks(min(batch, n), block_size, seed=block_size)
                tier.put(keys[: len(warm)], warm)  # warm-up: connections
                stored, put_s, served, get_s = _put_then_get(tier, keys, block_size, batch)
                unauthenticated = tier.stats()["unauthenticated_blocks"]
                for start in range(0, n, 1024):
                    tier.evict(keys[start : start + 1024])
            finally:
                tier.close()
            failed = _failed(stored, served, n)
            if failed or unauthenticated:
                raise ValueError(
                    f"the Redis tier ({name}) {failed or ''} ({unauthenticated} unauthenticated)"
                )
            row[f"{name}_put_gbps"] = _gbps(stored * block_size, put_s)
            row[f"{name}_get_gbps"] = _gbps(served * block_size, get_s)
        per_round.append(row)
    out: dict[str, Any] = {
        "block_size": block_size,
        "blocks": n,
        "rounds": rounds,
        "mac_algorithm": MAC_ALGORITHM,
    }
    for k in per_round[0]:
        out[k] = statistics.median(r[k] for r in per_round)
    for op in ("put", "get"):
        out[f"{op}_ratio"] = statistics.median(
            r[f"mac_{op}_gbps"] / r[f"plain_{op}_gbps"] for r in per_round
        )
    out["per_round"] = per_round
    out["steady"] = (
        _steady_gets(url, fp, secret, keys, block_size, batch, steady_passes)
        if steady_passes > 0
        else None
    )
    return out


def _steady_gets(
    url: str,
    fp: bytes,
    secret: bytes,
    keys: list[bytes],
    block_size: int,
    batch: int,
    passes: int,
) -> dict[str, Any]:
    """:func:`bench_redis_mac`'s steady-state gets (see there).

    Raises:
        ValueError: a namespace did not store or serve every block.
    """
    from kvoff.tiers.redis_cluster import RedisClusterTier

    n = len(keys)
    tiers = {
        name: RedisClusterTier(
            url,
            BlockFormat(fp, block_size, shared_secret=mode),
            namespace=f"kvoff-bench-steady-{name}",
            timeout_s=5.0,
        )
        for name, mode in (("plain", None), ("mac", secret))
    }
    outs = _aligned_blocks(min(batch, n), block_size, seed=2)

    def read_all(name: str) -> float:
        t0 = time.perf_counter()
        served = sum(
            sum(tiers[name].get(keys[s : s + batch], outs[: len(keys[s : s + batch])]))
            for s in range(0, n, batch)
        )
        seconds = time.perf_counter() - t0
        if served != n:
            raise ValueError(f"the Redis tier ({name}, steady gets) served {served:,} of {n:,}")
        return _gbps(n * block_size, seconds)

    try:
        for name, tier in tiers.items():
            stored, _, _, _ = _put_then_get(tier, keys, block_size, batch)  # fill, warm up
            if stored != n:
                raise ValueError(f"the Redis tier ({name}) stored {stored:,} of {n:,} blocks")
        per_pass = []
        for p in range(passes):
            order = ("plain", "mac") if p % 2 == 0 else ("mac", "plain")
            row = {f"{name}_get_gbps": read_all(name) for name in order}
            per_pass.append(row)
        for tier in tiers.values():
            for start in range(0, n, 1024):
                tier.evict(keys[start : start + 1024])
    finally:
        for tier in tiers.values():
            tier.close()
    ratios = [r["mac_get_gbps"] / r["plain_get_gbps"] for r in per_pass]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "passes": passes,
        "get_ratio": statistics.median(ratios),
        "get_ratio_q1": q1,
        "get_ratio_q3": q3,
        "per_pass": per_pass,
    }


def run_bench_tiers(
    disk_path: str | None,
    remote_url: str | None,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    total_bytes: int = 512 << 20,
    lookup_batch: int = 256,
    *,
    remote_total_bytes: int = 256 << 20,
    batch_bytes: int = 32 << 20,
    io_threads: int = 4,
    lookup_rounds: int = 200,
    start_local_redis: bool = True,
    disk_repeat: int = 3,
    mac_total_bytes: int = 256 << 20,
) -> dict[str, Any]:
    """Benchmark the disk tier against dd, and the Redis Cluster tier (module docstring).

    Args:
        disk_path: directory on the file system to measure (None: skip the disk).
        remote_url: ``redis://host:port`` of a cluster (None: start a local 3-master cluster if
            ``redis-server`` exists and ``start_local_redis``, else skip Redis).
        block_sizes: payload bytes per block.
        total_bytes: bytes of blocks per block size on disk.
        lookup_batch: keys per ``contains`` call for the lookup overhead.
        remote_total_bytes: bytes of blocks per block size on Redis (they must fit maxmemory).
        batch_bytes: bytes of blocks per put / get call.
        io_threads: the disk tier's I/O threads.
        lookup_rounds: ``contains`` calls timed per block size.
        start_local_redis: start a local cluster when ``remote_url`` is None.
        disk_repeat: side-by-side passes of the disk and dd per block size (medians reported).
        mac_total_bytes: bytes of 512 KiB blocks the MAC cost is measured on (:func:`bench_mac`;
            0: skipped); with Redis, also the bytes of :func:`bench_redis_mac` (at most
            ``remote_total_bytes``).

    Returns:
        ``{"run": ..., "parameters": ..., "disk": [per block size] | None, "redis": [...] |
        None, "redis_cluster": "url" | "local (started for the run)" | None, "mac": {...} |
        None, "redis_mac": {...} | None, "skipped": {...}}``.
    """
    from kvoff.tools.bench import run_info

    result: dict[str, Any] = {
        "run": run_info(),
        "parameters": {
            "block_sizes": list(block_sizes),
            "total_bytes": total_bytes,
            "remote_total_bytes": remote_total_bytes,
            "batch_bytes": batch_bytes,
            "lookup_batch": lookup_batch,
            "lookup_rounds": lookup_rounds,
            "io_threads": io_threads,
            "disk_repeat": disk_repeat,
            "mac_total_bytes": mac_total_bytes,
        },
        "disk": None,
        "redis": None,
        "redis_cluster": None,
        "mac": bench_mac(mac_total_bytes) if mac_total_bytes > 0 else None,
        "redis_mac": None,
        "skipped": {},
    }
    if disk_path is not None:
        Path(disk_path).mkdir(parents=True, exist_ok=True)
        result["disk"] = [
            bench_disk(Path(disk_path), bs, total_bytes, batch_bytes, io_threads, disk_repeat)
            for bs in block_sizes
        ]
    else:
        result["skipped"]["disk"] = "no disk_path given"
    cluster = None
    url = remote_url
    if url is None and start_local_redis:
        from kvoff.tiers.redis_cluster import LocalRedisCluster, redis_server_skip_reason

        reason = redis_server_skip_reason()
        if reason is None:
            cluster = LocalRedisCluster(maxmemory=f"{max(256, remote_total_bytes >> 19)}mb")
            cluster.start()
            url = cluster.url
        else:
            result["skipped"]["redis"] = reason
    try:
        if url is not None:
            result["redis_cluster"] = "local (started for the run)" if cluster else url
            result["redis"] = [
                bench_redis(url, bs, remote_total_bytes, batch_bytes, lookup_batch, lookup_rounds)
                for bs in block_sizes
            ]
            if mac_total_bytes > 0:
                result["redis_mac"] = bench_redis_mac(
                    url, total_bytes=min(mac_total_bytes, remote_total_bytes)
                )
    finally:
        if cluster is not None:
            cluster.stop()
    return result


def _failed(stored: int, served: int, blocks: int) -> str | None:
    """Why a tier's figures are not a full measurement (it stored or served fewer blocks than
    it was given), or None."""
    if stored == served == blocks:
        return None
    return f"stored {stored:,} of {blocks:,} blocks and served {served:,} of them"


def tier_failures(result: dict[str, Any]) -> list[str]:
    """One line per block size whose tier did not store and serve every block."""
    return [
        f"{name} tier, {_size(r['block_size'])} blocks: {r['failed']}"
        for name in ("disk", "redis")
        for r in result.get(name) or []
        if r.get("failed")
    ]


def format_bench_tiers(result: dict[str, Any]) -> str:
    """A text table of :func:`run_bench_tiers`'s result."""
    lines = []
    if result.get("disk"):
        lines.append(
            "disk tier vs dd (GB/s of payload, medians over passes; ratio = median of the "
            "passes' tier / dd)"
        )
        lines.append(
            f"{'block':>9} {'blocks':>7} {'write':>7} {'dd wr':>7} {'ratio':>6}"
            f" {'read':>7} {'dd rd':>7} {'ratio':>6}  direct"
        )
        for r in result["disk"]:
            lines.append(
                f"{_size(r['block_size']):>9} {r['blocks']:>7} {r['write_gbps']:>7.2f}"
                f" {r['dd_write_gbps']:>7.2f} {r['write_ratio']:>6.2f} {r['read_gbps']:>7.2f}"
                f" {r['dd_read_gbps']:>7.2f} {r['read_ratio']:>6.2f}  {r['direct_io']}"
            )
    for name, why in result.get("skipped", {}).items():
        lines.append(f"{name}: skipped ({why})")
    if result.get("redis"):
        lines.append(f"redis cluster tier ({result['redis_cluster']}; GB/s of payload)")
        lines.append(f"{'block':>9} {'blocks':>7} {'put':>7} {'get':>7} {'lookup µs/key':>14}")
        for r in result["redis"]:
            lines.append(
                f"{_size(r['block_size']):>9} {r['blocks']:>7} {r['put_gbps']:>7.2f}"
                f" {r['get_gbps']:>7.2f} {r['lookup_us_per_key']:>14.2f}"
            )
    mac = result.get("mac")
    if mac:
        g, spg = mac["gbps"], mac["s_per_gb"]
        lines.append(
            f"block MAC (shared_secret), {_size(mac['block_size'])} blocks, "
            f"{mac['payload_bytes'] >> 20} MiB, median of {mac['rounds']} rounds; GB/s (s/GB)"
        )
        names = {
            "mac": f"MAC: {mac.get('mac_algorithm', 'the block MAC')}",
            "hmac_sha256": "HMAC-SHA256 (format version 2)",
            "blake3_threads": "keyed BLAKE3, max_threads=AUTO",
            "blake2b": "keyed BLAKE2b-256",
            "checksum": "xxh3_64 checksum",
            "memcpy": "memcpy",
        }
        for m, gbps in g.items():
            over = mac.get("over_mac", {}).get(m)
            ratio = f"  {over:.2f}x the MAC's time" if over is not None and m != "mac" else ""
            lines.append(f"  {names.get(m, m):<60} {gbps:6.2f} ({spg[m]:.3f}){ratio}")
    rm = result.get("redis_mac")
    if rm:
        lines.append(
            f"redis tier with / without shared_secret, {_size(rm['block_size'])} blocks: gets "
            f"{rm['mac_get_gbps']:.2f} / {rm['plain_get_gbps']:.2f} GB/s ({rm['get_ratio']:.2f}x;"
            f" target >= 0.9), puts {rm['mac_put_gbps']:.2f} / {rm['plain_put_gbps']:.2f} GB/s "
            f"({rm['put_ratio']:.2f}x)"
        )
        st = rm.get("steady")
        if st:
            lines.append(
                f"  gets in steady state, {st['passes']} alternated passes: "
                f"{st['get_ratio']:.2f}x (quartiles {st['get_ratio_q1']:.2f}-"
                f"{st['get_ratio_q3']:.2f})"
            )
    lines += [f"FAILED: {line}" for line in tier_failures(result)]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"
