"""kvoff's secondary tiers under vLLM's OffloadingConnector: KvoffOffloadingManager with a real
disk tier (files in a temporary folder), driven one key at a time the way vLLM's
OffloadingConnectorScheduler drives it (lookup until a MISS, on_schedule_end once per step).
The engine end of the same path is in test_vllm.py
(test_a_disk_tier_through_vllms_offloading_connector)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

SLOT = 8192
POOL = 16


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00"


def _payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


def _manager(disk: Path, fingerprint: bytes = b"f" * 16):  # type: ignore[no-untyped-def]
    from kvoff.integrations.vllm import KvoffOffloadingManager
    from kvoff.tiers.block_format import BlockFormat
    from kvoff.tiers.disk import DiskTier

    pool = np.zeros((POOL, SLOT), dtype=np.uint8)
    m = KvoffOffloadingManager(POOL, "lru", True)
    m.attach_tiers([DiskTier(disk, 1 << 20, BlockFormat(fingerprint, SLOT))], pool.__getitem__)
    return m, pool


def _ctx(req: str = "r", tiers=None):  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import ReqContext, TierFilter

    return ReqContext(req_id=req, load_tier_filter=tiers or TierFilter.ALL)


def _scan(m, keys: list[bytes], ctx) -> list[str]:  # type: ignore[no-untyped-def]
    """vLLM's prefix scan: every key until the first MISS (RETRY does not stop it)."""
    out = []
    for k in keys:
        r = m.lookup(k, ctx).name
        out.append(r)
        if r == "MISS":
            break
    return out


def _steps_until_settled(m, limit: float = 30.0) -> int:  # type: ignore[no-untyped-def]
    """Engine steps (on_schedule_end) until no key waits for the tiers."""
    steps, t0 = 0, time.monotonic()
    while m.has_pending_work():
        assert time.monotonic() - t0 < limit, "the tiers never answered"
        m.on_schedule_end(None)
        steps += 1
        time.sleep(0.005)
    return steps


def _store(m, pool: np.ndarray, ids: range) -> None:  # type: ignore[no-untyped-def]
    keys = [_key(i) for i in ids]
    out = m.prepare_store(keys, _ctx())
    for k, b in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        pool[b] = _payload(int.from_bytes(k[:8], "big"))
    m.complete_store(keys, _ctx())
    m.tiers.wait()  # the write-through reached the disk


def _restarted(disk: Path, ids: range):  # type: ignore[no-untyped-def]
    """A manager that stores blocks ``ids`` through to ``disk`` and shuts down, then a new one
    (an empty CPU pool, the same disk): ``(manager, pool)`` of the new one."""
    first, pool = _manager(disk)
    _store(first, pool, ids)
    first.shutdown()
    return _manager(disk)


def test_a_restarted_manager_promotes_from_disk_and_loads_exact_bytes(tmp_path: Path) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    disk = tmp_path / "disk"
    first, pool = _manager(disk)
    _store(first, pool, range(4))
    assert first.tiers.stats()["tiers"]["disk"]["written_blocks"] == 4
    first.shutdown()

    m, pool = _manager(disk)  # a new process's manager: an empty CPU pool, the same disk
    keys = [_key(i) for i in range(6)]  # 4 on disk, then 2 never stored
    ctx = _ctx()
    assert _scan(m, keys, ctx) == ["RETRY"] * 6  # the scan goes on past RETRY
    assert _scan(m, keys, _ctx("other")) == ["RETRY"] * 6  # asked once, not twice
    assert m.has_pending_work()
    m.on_schedule_end(None)  # the probe starts
    while m.tiers.is_reading(keys[0]):  # asked again while the tiers read: counted per request
        # probing: RETRY; reading into reserved slots: HIT_PENDING (never a HIT or MISS yet)
        assert set(_scan(m, keys, ctx)) <= {"RETRY", "HIT_PENDING"}
        retries = m.tiers.lookup_retries
        assert set(_scan(m, keys, ctx)) <= {"RETRY", "HIT_PENDING"}
        assert m.tiers.lookup_retries == retries  # the same request in the same step
        m.on_schedule_end(None)
        time.sleep(0.002)
    _steps_until_settled(m)
    assert m.tiers.probes == 1
    assert _scan(m, keys, ctx) == ["HIT"] * 4 + ["MISS"]
    blocks = m.prepare_load(keys[:4], ctx).block_ids
    for i, b in enumerate(blocks):
        assert np.array_equal(pool[b], _payload(i))  # byte-exact
    m.complete_load(keys[:4], ctx)
    assert m.get_load_source(keys[0], ctx) == CacheHitSource.DISK
    assert m.get_load_source(keys[0], ctx) == CacheHitSource.HOST  # from the pool since

    stats = m.get_stats()
    data = stats.reduce()
    assert data["vllm:kvoff_disk_promoted_blocks"] == 4
    assert data["vllm:kvoff_disk_promoted_bytes"] == 4 * SLOT
    assert data["vllm:kvoff_tier_probes"] == 1
    moved = m.get_stats().reduce()  # nothing moved since: vLLM's usage gauges only
    assert not any(k.startswith("vllm:kvoff_") for k in moved), moved
    assert moved["vllm:kv_offload_cpu_cache_usage_perc"] == 0.0
    # the promoted blocks are CPU pool blocks (events), not written through again
    assert m.tiers.stats()["tiers"]["disk"]["written_blocks"] == 0
    m.shutdown()


def test_a_reset_leaves_no_block_of_before_it_in_any_tier(tmp_path: Path) -> None:
    """vLLM's reset_prefix_cache(reset_connector=True) after a weight update: the disk's blocks
    are as wrong as the pool's. Without the tiers' reset the scan below promotes them (HIT)."""
    m, pool = _manager(tmp_path / "disk")
    _store(m, pool, range(4))
    assert m.tiers.stats()["tiers"]["disk"]["written_blocks"] == 4
    m.get_stats()  # takes the counters so far: only the reset's moves are left below
    m.reset_cache()
    st = m.tiers.stats()
    assert st["resets"] == 1 and st["tiers"]["disk"]["blocks_cleared"] == 4
    data = m.get_stats().reduce()  # and as Prometheus counters
    assert data["vllm:kvoff_tier_resets"] == 1
    assert data["vllm:kvoff_disk_blocks_cleared"] == 4
    assert st["tiers"]["disk"]["blocks"] == 0
    keys, ctx = [_key(i) for i in range(4)], _ctx()
    assert _scan(m, keys, ctx) == ["RETRY"] * 4  # the pool misses: the tiers are asked
    _steps_until_settled(m)
    assert _scan(m, keys, ctx) == ["MISS"]  # ... and hold nothing from before the reset
    _store(m, pool, range(4))  # stored again (the new weights' KV): written through as usual
    assert m.tiers.stats()["tiers"]["disk"]["written_blocks"] == 8
    assert _scan(m, keys, ctx) == ["HIT"] * 4
    m.shutdown()


def test_a_missed_key_stays_a_miss_for_a_few_steps_then_is_asked_again(tmp_path: Path) -> None:
    from kvoff.integrations.vllm import SETTLED_STEPS

    m, _ = _manager(tmp_path / "disk")
    key, ctx = _key(9), _ctx()
    assert m.lookup(key, ctx).name == "RETRY"
    _steps_until_settled(m)
    for _ in range(SETTLED_STEPS):  # the lookups of the next SETTLED_STEPS steps
        assert m.lookup(key, ctx).name == "MISS"
        m.on_schedule_end(None)
    assert m.lookup(key, ctx).name == "RETRY"  # the answer expired: the tiers are asked again
    _steps_until_settled(m)
    assert m.tiers.probes == 2
    m.shutdown()


def test_a_corrupted_block_on_disk_is_a_miss_and_never_served(tmp_path: Path) -> None:
    from kvoff.tiers.block_format import HEADER_BYTES
    from kvoff.tiers.disk import SUPERBLOCK_BYTES

    disk = tmp_path / "disk"
    m, _ = _restarted(disk, range(2))
    path = disk / "kvoff-blocks.slots"
    with open(path, "r+b") as fh:  # one payload byte of the first slot (not read yet)
        fh.seek(SUPERBLOCK_BYTES + HEADER_BYTES + 100)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))

    keys, ctx = [_key(0), _key(1)], _ctx()
    assert _scan(m, keys, ctx) == ["RETRY", "RETRY"]
    _steps_until_settled(m)
    assert _scan(m, keys, ctx) == ["MISS"]  # the prefix stops at the corrupted block
    assert m.manager.lookup([_key(0)]) == 0  # it never became a CPU pool block
    assert m.tiers.stats()["tiers"]["disk"]["corrupted_blocks"] == 1
    m.shutdown()


def test_a_request_that_excludes_the_disk_tier_does_not_ask_it(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import Locality, Medium, TierFilter, TierMatcher

    m, _ = _restarted(tmp_path / "disk", range(1))
    remote_only = TierFilter(matchers=(TierMatcher(Medium.STORAGE, Locality.REMOTE),))
    assert m.lookup(_key(0), _ctx("r", remote_only)).name == "MISS"
    assert not m.has_pending_work() and m.tiers.probes == 0
    local = TierFilter(matchers=(TierMatcher(Medium.STORAGE, Locality.LOCAL),))
    assert m.lookup(_key(0), _ctx("s", local)).name == "RETRY"
    _steps_until_settled(m)
    assert m.lookup(_key(0), _ctx("s", local)).name == "HIT"
    m.shutdown()


def test_the_fingerprint_tells_the_ways_in_ranks_and_models_apart() -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    from kvoff.integrations.vllm.tier_wiring import spec_fingerprint

    def config(model: str = "m", world: int = 1) -> SimpleNamespace:
        return SimpleNamespace(
            model=SimpleNamespace(name=model, dtype="float32"),
            groups=(OffloadingGroupConfig(128, ("l0", "l1"), 0),),
            cache=SimpleNamespace(tokens_per_hash=128, blocks_per_chunk=1),
            worker_kv_bytes_per_block=1024,
            kv_cache_layout="LBHNC",
            canonical_layout=False,
            parallel=SimpleNamespace(world_size=world, tp_size=world, pp_size=1),
        )

    base = spec_fingerprint(config(), 0)
    assert len(base) == 16 and base == spec_fingerprint(config(), 0)
    assert base != spec_fingerprint(config(), 1)
    assert base != spec_fingerprint(config(model="other"), 0)
    assert base != spec_fingerprint(config(world=2), 0)


def test_without_tiers_the_manager_answers_from_the_pool_alone() -> None:
    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(4, "lru", False)
    assert m.lookup(_key(1), _ctx()).name == "MISS"
    assert not m.has_pending_work()
    assert set(m.get_stats().reduce()) == {  # vLLM's CPU metrics, no tier counter
        "vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_offload_cpu_cache_write_usage_perc",
        "vllm:kv_offload_cpu_cache_read_usage_perc",
    }  # fmt: skip
    m.on_schedule_end(None)
    m.shutdown()


def test_complete_store_leaves_keys_that_are_not_pending_as_vllms_manager_does() -> None:
    """vLLM's OffloadingManager contract: complete_store(success=False) removes the blocks not
    marked as stored yet and leaves the stored ones; keys that are not pending (stored already,
    or dropped by a reset) are skipped, not refused. Checked side by side with vLLM's own
    CPUOffloadingManager."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvoff.integrations.vllm import KvoffOffloadingManager

    a, b, c = _key(1), _key(2), _key(3)
    seen = {}
    managers = (
        ("vllm", CPUOffloadingManager(2)),
        ("kvoff", KvoffOffloadingManager(2, "lru", False)),
    )
    for name, m in managers:
        ctx = _ctx()
        m.on_new_request(ctx)
        m.prepare_store([a, b], ctx)
        m.complete_store([a], ctx)
        m.complete_store([a, b], ctx, success=False)  # a stored already, b failed
        states = [m.lookup(k, ctx).name for k in (a, b)]
        m.complete_store([a, c], ctx)  # a stored already, c never prepared: both skipped
        states += [m.lookup(k, ctx).name for k in (a, c)]
        assert m.prepare_store([c], ctx) is not None  # b's slot was freed
        seen[name] = states
    assert seen["kvoff"] == seen["vllm"] == ["HIT", "MISS", "HIT", "MISS"]
    with pytest.raises(TypeError):
        KvoffOffloadingManager(2, "lru", False).complete_store([1.5], _ctx())  # type: ignore[list-item]


def test_a_disk_too_small_for_every_rank_names_the_configured_size(tmp_path: Path) -> None:
    """With two ranks each rank's disk tier gets half of disk_bytes: the error names the
    configured value and the size that would work, and leaves no tier open."""
    from kvoff.config import OffloadingConfig
    from kvoff.tiers.block_format import BlockFormat
    from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for
    from kvoff.tiers.engine_tiers import tiers_on_pools

    views = [np.zeros((POOL, SLOT), dtype=np.uint8) for _ in range(2)]
    need = SUPERBLOCK_BYTES + slot_bytes_for(BlockFormat(b"f" * 16, SLOT))
    config = OffloadingConfig(num_cpu_blocks=POOL, disk_path=tmp_path, disk_bytes=need)
    with pytest.raises(ValueError, match=rf"disk_bytes={need} is split over 2 ranks.*{2 * need}"):
        tiers_on_pools(config, views, lambda r: bytes([r]) * 16)
    ok = OffloadingConfig(num_cpu_blocks=POOL, disk_path=tmp_path, disk_bytes=2 * need)
    tiers, _ = tiers_on_pools(ok, views, lambda r: bytes([r]) * 16)  # no file left locked
    assert [t.name for t in tiers] == ["disk"]
    for t in tiers:
        t.close()


def test_a_promotion_keeps_the_request_s_own_hits_in_the_pool(tmp_path: Path) -> None:
    """The pool is full: the request's first two blocks are its oldest, 14 others newer, and
    the disk holds the request's next two. Promoting them must evict two of the others, not
    the request's own hits (before, it evicted them: the next scan missed at its first block
    and asked the tiers again)."""
    disk = tmp_path / "disk"
    m, pool = _restarted(disk, range(2, 4))  # the disk holds k2, k3; the pool is empty
    _store(m, pool, range(2))  # the request's hits, least recent
    _store(m, pool, range(100, 100 + POOL - 2))  # the pool is full
    keys, ctx = [_key(i) for i in range(4)], _ctx()
    assert _scan(m, keys, ctx) == ["HIT", "HIT", "RETRY", "RETRY"]
    _steps_until_settled(m)
    assert _scan(m, keys, ctx) == ["HIT"] * 4  # the whole run, its own hits kept
    blocks = m.prepare_load(keys, ctx).block_ids
    for i, b in enumerate(blocks):
        assert np.array_equal(pool[b], _payload(i))
    m.complete_load(keys, ctx)
    others = [m.manager.lookup([_key(i)]) for i in range(100, 100 + POOL - 2)]
    assert sum(others) == POOL - 4  # two of the others made the room
    m.shutdown()
