"""The disk tier (kvoff.tiers.disk.DiskTier): restart, corruption, foreign layouts, a full or
unwritable disk, LRU eviction, concurrency, and a stateful model of random operations. Opening
its slot file (refusals, O_DIRECT, free space) is tested in test_slot_file.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from disk_tier_util import (
    FMT,
    FORMATS,
    ODD_FMT,
    aligned,
    block,
    capacity,
    flip_file_byte,
    key,
    open_fds,
    outs,
    supports_o_direct,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoff.tiers.block_format import HEADER_BYTES, BlockFormat, layout_fingerprint
from kvoff.tiers.disk import DiskTier


@pytest.fixture(scope="module")
def written_by_another_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One subprocess writes keys 0..9 to a tier of each format, then exits."""
    dirs = {name: tmp_path_factory.mktemp(f"restart-{name}") for name in FORMATS}
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from disk_tier_util import FORMATS, block, capacity, key
        from kvoff.tiers import DiskTier
        for name, path in { ({k: str(v) for k, v in dirs.items()})!r}.items():
            fmt = FORMATS[name]
            tier = DiskTier(path, capacity(fmt, 16), fmt)
            keys = [key(i) for i in range(10)]
            assert tier.put(keys, [block(k, fmt) for k in keys]) == [True] * 10
            tier.close()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dirs


@pytest.mark.parametrize("page_aligned", [False, True], ids=["unaligned", "aligned"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_round_trip_and_index_rebuilt_in_another_process(
    written_by_another_process: dict[str, Path], name: str, page_aligned: bool
) -> None:
    fmt = FORMATS[name]
    keys = [key(i) for i in range(10)]
    tier = DiskTier(written_by_another_process[name], capacity(fmt, 16), fmt)
    st_ = tier.stats()
    assert st_["recovered_blocks"] == 10 and st_["blocks"] == 10
    assert tier.contains([*keys, key(99)]) == [True] * 10 + [False]
    bufs = outs(11, fmt, page_aligned=page_aligned)
    assert tier.get([*keys, key(99)], bufs) == [True] * 10 + [False]
    for k, b in zip(keys, bufs, strict=False):
        np.testing.assert_array_equal(b, block(k, fmt))
    st_ = tier.stats()
    assert (st_["hits"], st_["misses"], st_["corrupted_blocks"]) == (10, 1, 0)
    assert st_["direct_io"] == supports_o_direct(tier.dir)
    tier.check_consistency()
    tier.close()


@pytest.mark.parametrize("where", ["payload-first", "payload-last", "header-key", "header-sum"])
@pytest.mark.parametrize("page_aligned", [False, True], ids=["unaligned", "aligned"])
def test_flipped_byte_is_a_counted_miss_never_served(
    tmp_path: Path, where: str, page_aligned: bool
) -> None:
    keys = [key(i) for i in range(4)]
    tier = DiskTier(tmp_path, capacity(FMT, 8), FMT)
    assert all(tier.put(keys, [block(k) for k in keys]))
    victim = keys[2]
    base = tier.slot_offset(tier.slot_of(victim))  # type: ignore[arg-type]
    offset = {
        "payload-first": HEADER_BYTES,
        "payload-last": HEADER_BYTES + FMT.payload_bytes - 1,
        "header-key": 70,
        "header-sum": 125,
    }[where]
    tier.close()
    flip_file_byte(tier.file, base + offset)  # while closed: the restart sees it too

    tier = DiskTier(tmp_path, capacity(FMT, 8), FMT)
    header_corrupt = where.startswith("header")
    assert tier.contains([victim]) == [not header_corrupt]  # a bad header is not even indexed
    bufs = outs(4, page_aligned=page_aligned)
    assert tier.get(keys, bufs) == [True, True, False, True]
    assert tier.stats()["corrupted_blocks"] == 1
    assert tier.stats()["hits"] == 3
    # dropped: never served later either, and the slot is reused
    assert tier.contains([victim]) == [False]
    assert tier.get([victim], outs(1)) == [False]
    assert tier.stats()["corrupted_blocks"] == 1
    tier.check_consistency()
    assert tier.put([victim], [block(victim)]) == [True]
    again = outs(1)
    assert tier.get([victim], again) == [True]
    np.testing.assert_array_equal(again[0], block(victim))
    tier.close()


def test_consecutive_slots_are_read_in_runs_and_mixed_outputs_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch in consecutive slots is read with one preadv per RUN_BYTES (headers and
    payloads together); unaligned outputs break runs but are served all the same."""
    import kvoff.tiers.disk as disk_mod

    n = 200
    keys = [key(i) for i in range(n)]
    tier = DiskTier(tmp_path, capacity(FMT, n), FMT)
    assert all(tier.put(keys, [block(k) for k in keys]))
    per_run = disk_mod.RUN_BYTES // tier.slot_bytes  # 128 slots of 16 KiB
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list, offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_mod.os, "preadv", counting)
    bufs = outs(n, page_aligned=True)
    assert tier.get(keys, bufs) == [True] * n
    assert all(np.array_equal(b, block(k)) for b, k in zip(bufs, keys, strict=True))
    if tier.stats()["direct_io"]:
        # two runs on two I/O threads: either may call preadv first
        assert sorted(calls) == sorted([2 * per_run, 2 * (n - per_run)])
    calls.clear()
    mixed = [aligned(FMT.payload_bytes) if i % 3 else outs(1)[0] for i in range(12)]
    assert tier.get(keys[:12], mixed) == [True] * 12
    assert all(np.array_equal(b, block(k)) for b, k in zip(mixed, keys[:12], strict=True))
    assert len(calls) < 12 and tier.stats()["corrupted_blocks"] == 0
    tier.close()


def test_consecutive_slots_are_written_in_runs_and_unaligned_payloads_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put into consecutive slots writes each run (headers and payloads) with one pwritev
    per RUN_BYTES; an unaligned payload is written alone, through the bounce buffer, header and
    payload in one call. Everything reads back byte-exact, also after a restart."""
    import kvoff.tiers.disk as disk_mod

    n = 200
    keys = [key(i) for i in range(n)]
    tier = DiskTier(tmp_path, capacity(FMT, n + 12), FMT)
    per_run = disk_mod.RUN_BYTES // tier.slot_bytes  # 128 slots of 16 KiB
    calls: list[tuple[str, int]] = []
    real_v, real = os.pwritev, os.pwrite

    def counting_v(fd: int, buffers: list, offset: int) -> int:
        calls.append(("pwritev", len(buffers)))
        return real_v(fd, buffers, offset)

    def counting(fd: int, data: object, offset: int) -> int:
        calls.append(("pwrite", 1))
        return real(fd, data, offset)

    monkeypatch.setattr(disk_mod.os, "pwritev", counting_v)
    monkeypatch.setattr(disk_mod.os, "pwrite", counting)
    payloads = [block(k) for k in keys]
    aligned_payloads = []
    for p in payloads:
        a = aligned(FMT.payload_bytes)
        a[:] = p
        aligned_payloads.append(a)
    assert tier.put(keys, aligned_payloads) == [True] * n
    if tier.stats()["direct_io"]:
        assert sorted(calls) == sorted([("pwritev", 2 * per_run), ("pwritev", 2 * (n - per_run))])
    calls.clear()
    more = [key(1000 + i) for i in range(12)]
    mixed = [aligned(FMT.payload_bytes) if i % 3 else outs(1)[0] for i in range(12)]
    for m, k in zip(mixed, more, strict=True):
        m[:] = block(k)
    assert tier.put(more, mixed) == [True] * 12
    assert len(calls) < 12 and tier.stats()["io_errors"] == 0
    if tier.stats()["direct_io"]:
        assert ("pwrite", 1) in calls  # the unaligned ones, one call each
    tier.close()
    monkeypatch.undo()
    again = DiskTier(tmp_path, capacity(FMT, n + 12), FMT)  # the index rebuilt from headers
    bufs = outs(n + 12)
    assert again.get([*keys, *more], bufs) == [True] * (n + 12)
    expect = [*payloads, *(block(k) for k in more)]
    assert all(np.array_equal(b, e) for b, e in zip(bufs, expect, strict=True))
    again.close()


def test_clear_drops_every_block_for_good_and_a_put_across_it_indexes_nothing(
    tmp_path: Path,
) -> None:
    """clear() (a cache reset: the blocks are wrong KV now) zeroes every header, so a restart
    does not bring the blocks back; a put whose write straddles the clear is not indexed (its
    block was made before the reset); puts after it are served as usual."""
    tier = DiskTier(tmp_path, capacity(FMT, 8), FMT)
    keys = [key(i) for i in range(6)]
    assert tier.put(keys[:4], [block(k) for k in keys[:4]]) == [True] * 4
    bufs = outs(1)
    assert tier.get(keys[:1], bufs) == [True]
    write_run = tier._write_run

    def write_then_clear(run):  # type: ignore[no-untyped-def]
        errors = write_run(run)
        tier.clear()  # a reset while this put's blocks are on their way to the disk
        return errors

    tier._write_run = write_then_clear  # type: ignore[method-assign]
    assert tier.put(keys[4:5], [block(keys[4])]) == [False]
    del tier._write_run
    st_ = tier.stats()
    assert st_["blocks"] == 0 and st_["evictions"] == 4 and st_["writes_dropped"] == 1
    assert tier.contains(keys) == [False] * 6
    assert tier.get(keys[:1], bufs) == [False]
    assert tier.put(keys[5:], [block(keys[5])]) == [True]  # after the clear: served
    assert tier.contains(keys) == [False] * 5 + [True]
    tier.check_consistency()
    tier.close()
    again = DiskTier(tmp_path, capacity(FMT, 8), FMT)  # a restart finds only the new block
    assert again.stats()["recovered_blocks"] == 1
    assert again.contains(keys) == [False] * 5 + [True]
    again.close()
    assert again.clear() == 0  # closed: nothing to drop, no error


def test_corruption_while_open_is_detected_by_get(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    k = key(1)
    tier.put([k], [block(k)])
    flip_file_byte(tier.file, tier.slot_offset(tier.slot_of(k)) + HEADER_BYTES + 999)  # type: ignore[arg-type]
    assert tier.get([k], outs(1)) == [False]
    assert tier.stats()["corrupted_blocks"] == 1 and tier.contains([k]) == [False]
    tier.close()


def test_wrong_fingerprint_is_a_miss_and_its_slots_are_reused(tmp_path: Path) -> None:
    keys = [key(i) for i in range(4)]
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    assert all(tier.put(keys, [block(k) for k in keys]))
    tier.close()
    other = BlockFormat(
        layout_fingerprint(model="tiny", dtype="float16", world_size=1, rank=1, block_size=16),
        FMT.payload_bytes,
    )
    tier = DiskTier(tmp_path, capacity(other, 4), other)
    assert tier.contains(keys) == [False] * 4
    assert tier.get(keys, outs(4)) == [False] * 4
    assert tier.stats()["fingerprint_mismatches"] == 4
    # all four slots are free for this layout: no eviction needed
    new = [key(i) for i in range(10, 14)]
    assert tier.put(new, [block(k) for k in new]) == [True] * 4
    assert tier.stats()["evictions"] == 0
    tier.close()


def test_bad_config_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"disk_bytes=8192 is smaller than one block.*at least"):
        DiskTier(tmp_path, 8192, FMT)
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(tmp_path / "afile", capacity(FMT, 4), FMT)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "kvoff-blocks.slots").write_bytes(b"precious data" * 1000)
    with pytest.raises(ValueError, match="not a kvoff disk tier file"):
        DiskTier(tmp_path / "d", capacity(FMT, 4), FMT)
    assert (tmp_path / "d" / "kvoff-blocks.slots").read_bytes() == b"precious data" * 1000
    tier = DiskTier(tmp_path / "e", capacity(FMT, 4), FMT)
    with pytest.raises(ValueError, match="in use by another DiskTier"):
        DiskTier(tmp_path / "e", capacity(FMT, 4), FMT)
    with pytest.raises(ValueError, match="payload_bytes is"):
        tier.put([key(1)], [np.zeros(10, np.uint8)])
    tier.close()
    for name in ("", ".", "..", "a/b", "x\0y"):  # an unavailable tier before, not an error
        with pytest.raises(ValueError, match=r"file_name=.* must name a file inside path"):
            DiskTier(tmp_path / "f", capacity(FMT, 4), FMT, file_name=name)
    assert not (tmp_path / "f").exists()  # nothing was made


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"capacity_bytes": 53248.0}, TypeError, "disk_bytes=53248.0 must be an int number of"),
        ({"capacity_bytes": "1GiB"}, TypeError, "disk_bytes='1GiB' must be an int .*parse_byte"),
        ({"capacity_bytes": float("nan")}, TypeError, "disk_bytes=nan must be an int number"),
        ({"capacity_bytes": True}, TypeError, "disk_bytes=True must be an int number of bytes"),
        ({"capacity_bytes": None}, TypeError, "disk_bytes=None must be an int number of bytes"),
        ({"io_threads": True}, TypeError, "io_threads=True must be an int >= 1, not a bool"),
        ({"io_threads": 2.0}, TypeError, "io_threads=2.0 must be an int >= 1, not a float"),
        ({"io_threads": 0}, ValueError, "io_threads=0 must be an int >= 1"),
        ({"direct": 0}, TypeError, "direct=0 must be True .*, False .* or None"),
        ({"direct": 1}, TypeError, "direct=1 must be True"),
        ({"direct": "false"}, TypeError, "direct='false' must be True"),
        ({"direct": "yes"}, TypeError, "direct='yes' must be True"),
    ],
    ids=repr,
)
def test_bad_argument_types_are_refused_naming_the_value(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Before, a float or "1GiB" capacity got the false diagnosis "smaller than one block",
    io_threads=True was taken as 1, and any ``direct`` but False (0, "false") meant O_DIRECT.
    A refusal creates nothing."""
    args: dict[str, object] = {"capacity_bytes": capacity(FMT, 4), **kwargs}
    with pytest.raises(error, match=message):
        DiskTier(tmp_path / "t", fmt=FMT, **args)  # type: ignore[arg-type]
    assert not (tmp_path / "t").exists()


def test_numpy_integer_sizes_and_counts_are_ints(tmp_path: Path) -> None:
    """A NumPy integer is an int (before, np.int64 capacities were refused as "smaller than one
    block")."""
    tier = DiskTier(tmp_path, np.int64(capacity(FMT, 4)), FMT, io_threads=np.int32(2))  # type: ignore[arg-type]
    assert tier.num_slots == 4 and type(tier.capacity_bytes) is int
    assert tier.put([key(1)], [block(key(1))]) == [True]
    tier.close()
    tier = DiskTier(tmp_path / "b", capacity(FMT, 4), FMT, direct=False)
    assert tier.stats()["direct_io"] == 0  # False still means buffered I/O
    tier.close()


def test_contains_and_evict_check_keys_and_answer_nothing_once_closed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    assert tier.put([key(1)], [block(key(1))]) == [True]
    for bad in (["a str key"], [7], [b""], [b"x" * 65]):
        with pytest.raises(ValueError, match=r"offload keys must be bytes of 1\.\.64"):
            tier.contains(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"offload keys must be bytes of 1\.\.64"):
            tier.evict(bad)  # type: ignore[arg-type]
    assert tier.contains([key(1)]) == [True]  # the bad calls changed nothing
    assert tier.stats()["lookups"] == 1
    tier.close()
    assert tier.contains([key(1)]) == [False]
    assert tier.evict([key(1)]) == 0


def test_batches_that_are_no_lists_are_named_and_change_nothing(tmp_path: Path) -> None:
    """'int' object is not iterable, or a bytes key read as a list of ints, before."""
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    good = [key(1)]
    assert tier.put(good, [block(key(1))]) == [True]
    keys_msg = r"keys must be a list or tuple of offload keys \(bytes\), got "
    for bad, shown in ((key(2), "bytes"), (None, "NoneType"), (7, "int")):
        for call in (
            lambda bad=bad: tier.contains(bad),
            lambda bad=bad: tier.evict(bad),
            lambda bad=bad: tier.get(bad, outs(1)),
            lambda bad=bad: tier.put(bad, [block(key(2))]),
        ):
            with pytest.raises(TypeError, match=keys_msg + shown):
                call()  # type: ignore[arg-type]
    for bufs, shown in ((None, "NoneType"), (block(key(2)), "ndarray"), ("ab", "str")):
        with pytest.raises(
            TypeError,
            match=r"payloads must be a list or tuple of buffers, one "
            r"per key \(or an array of a row per key\), got " + shown,
        ):
            tier.put([key(2)], bufs)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"outs\[i\] must be a uint8 numpy array or a "
        r"bytes-like object of \d+ bytes, got NoneType",
    ):
        tier.get(good, [None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"payloads\[i\] must be .*got int"):
        tier.put([key(2)], [7])  # type: ignore[list-item]
    assert tier.contains([key(1), key(2)]) == [True, False]  # nothing was written or evicted
    # a 2-D array is a batch of a row per key
    rows = np.stack([block(key(3)), block(key(4))])
    assert tier.put([key(3), key(4)], rows) == [True, True]
    back = np.zeros_like(rows)
    assert tier.get([key(3), key(4)], back) == [True, True] and np.array_equal(back, rows)
    tier.close()


def test_unwritable_path_drops_writes_and_never_raises(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    tier = DiskTier(tmp_path / "file" / "tier", capacity(FMT, 4), FMT)  # parent is a file
    assert tier.error is not None and "unavailable" in tier.error
    keys = [key(i) for i in range(3)]
    assert tier.put(keys, [block(k) for k in keys]) == [False] * 3
    assert tier.get(keys, outs(3)) == [False] * 3
    assert tier.contains(keys) == [False] * 3
    assert tier.evict(keys) == 0
    s = tier.stats()
    assert (s["writes_dropped"], s["misses"], s["unavailable"]) == (3, 3, 1)
    tier.close()


def test_file_size_limit_drops_and_counts_writes(tmp_path: Path) -> None:
    """A real EFBIG: RLIMIT_FSIZE allows the superblock and three slots; SIGXFSZ is ignored, as
    an engine must. Preallocation fails, three blocks are stored, the rest are dropped."""
    limit = capacity(FMT, 3)
    script = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from disk_tier_util import FMT, block, capacity, key, outs
        from kvoff.tiers import DiskTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        tier = DiskTier({str(tmp_path)!r}, capacity(FMT, 8), FMT)
        keys = [key(i) for i in range(8)]
        stored = tier.put(keys, [block(k) for k in keys])
        later = tier.put([key(50)], [block(key(50))])
        bufs = outs(8)
        got = tier.get(keys, bufs)
        exact = all((b == block(k)).all() for k, b, ok in zip(keys, bufs, got) if ok)
        tier.check_consistency()
        print(json.dumps(dict(stored=stored, later=later, got=got, exact=exact, **tier.stats())))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["preallocated"] == 0
    assert sum(r["stored"]) == 3 and r["later"] == [False]
    assert r["got"] == r["stored"] and r["exact"]
    assert r["writes_dropped"] == 6 and r["io_errors"] == 6
    assert r["blocks"] == 3 and r["corrupted_blocks"] == 0


def test_lru_eviction_when_full(tmp_path: Path) -> None:
    a, b, c, d, e = (key(i) for i in range(5))
    tier = DiskTier(tmp_path, capacity(FMT, 3), FMT)
    assert tier.put([a, b, c], [block(k) for k in (a, b, c)]) == [True] * 3
    assert tier.get([a], outs(1)) == [True]  # a is now the most recently used
    assert tier.put([d], [block(d)]) == [True]  # evicts b, the LRU block
    assert tier.contains([a, b, c, d]) == [True, False, True, True]
    assert tier.stats()["evictions"] == 1
    # a put of a held key refreshes it: c becomes MRU, so e evicts a
    assert tier.put([c], [block(c)]) == [True]
    assert tier.put([e], [block(e)]) == [True]
    assert tier.held_keys() == [d, c, e]
    # the keys of one put never evict each other: 5 new keys, 3 slots -> 3 stored, 2 dropped
    new = [key(i) for i in range(10, 15)]
    assert tier.put(new, [block(k) for k in new]) == [True] * 3 + [False] * 2
    assert tier.stats()["writes_dropped"] == 2
    assert tier.evict([new[0], key(99)]) == 1
    tier.check_consistency()
    tier.close()


def test_concurrent_get_put_evict(tmp_path: Path) -> None:
    """Reads, writes and evictions from three threads; every served block is byte-exact."""
    tier = DiskTier(tmp_path, capacity(FMT, 12), FMT, io_threads=3)
    errors: list[BaseException] = []
    served = [0]

    done = threading.Event()
    pool = {k: block(k) for k in (key(i) for i in range(40))}

    def writer() -> None:
        rng = np.random.default_rng(1)
        for _ in range(300):
            ks = [key(int(i)) for i in rng.choice(40, 4, replace=False)]
            tier.put(ks, [pool[k] for k in ks])
        done.set()

    def reader() -> None:
        rng = np.random.default_rng(2)
        while not done.is_set():
            ks = [key(int(i)) for i in rng.choice(40, 4, replace=False)]
            bufs = outs(4)
            for k, b, ok in zip(ks, bufs, tier.get(ks, bufs), strict=True):
                if ok:
                    served[0] += 1
                    if not np.array_equal(b, pool[k]):
                        raise AssertionError(f"served wrong bytes for {k.hex()}")

    def evicter() -> None:
        rng = np.random.default_rng(3)
        while not done.is_set():
            done.wait(0.001)
            tier.evict([key(int(rng.integers(40)))])

    def guard(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=guard(f)) for f in (writer, reader, evicter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert served[0] > 0
    assert tier.stats()["corrupted_blocks"] == 0
    tier.check_consistency()
    tier.close()


KEYS = [key(i) for i in range(7)]
CAP = 4


class DiskTierMachine(RuleBasedStateMachine):
    """Random put / get / contains / evict / corrupt / reopen against an LRU dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvoff-disk-")
        self.tier = DiskTier(self.dir, capacity(ODD_FMT, CAP), ODD_FMT, io_threads=2)
        self.model: OrderedDict[bytes, int] = OrderedDict()  # key -> version, LRU order
        self.written: dict[bytes, int] = {}  # key -> write sequence number
        self.corrupt: set[bytes] = set()
        self.seq = 0

    def _store(self, batch: list[tuple[bytes, int]]) -> list[bool]:
        """What the tier answers: held keys are refreshed in batch order, new keys take a free
        slot or the LRU block's (never one of this batch) and become MRU once all are written."""
        held = {k for k, _ in batch if k in self.model}
        expect: list[bool] = []
        seen: dict[bytes, int] = {}
        added: list[tuple[bytes, int]] = []
        for k, v in batch:
            if k in held:
                self.model.move_to_end(k)
                expect.append(True)
            elif k in seen:
                expect.append(expect[seen[k]])
            else:
                seen[k] = len(expect)
                if len(self.model) + len(added) >= CAP:
                    victim = next((x for x in self.model if x not in held), None)
                    if victim is None:
                        expect.append(False)
                        continue
                    del self.model[victim]
                    self.corrupt.discard(victim)
                added.append((k, v))
                expect.append(True)
        for k, v in added:
            self.model[k] = v
            self.seq += 1
            self.written[k] = self.seq
        return expect

    @rule(k=st.sampled_from(KEYS), v=st.integers(0, 3))
    def put_one(self, k: bytes, v: int) -> None:
        expect = self._store([(k, v)])
        assert self.tier.put([k], [block(k, ODD_FMT, v)]) == expect

    @rule(
        batch=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 3)), min_size=1, max_size=6)
    )
    def put_many(self, batch: list[tuple[bytes, int]]) -> None:
        expect = self._store(batch)
        got = self.tier.put([k for k, _ in batch], [block(k, ODD_FMT, v) for k, v in batch])
        assert got == expect

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def get(self, ks: list[bytes]) -> None:
        bufs = outs(len(ks), ODD_FMT)
        got = self.tier.get(ks, bufs)
        for k, b, ok in zip(ks, bufs, got, strict=True):
            if k in self.model and k not in self.corrupt:
                assert ok
                np.testing.assert_array_equal(b, block(k, ODD_FMT, self.model[k]))
                self.model.move_to_end(k)
            else:
                assert not ok
                self.model.pop(k, None)
                self.corrupt.discard(k)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def contains(self, ks: list[bytes]) -> None:
        assert self.tier.contains(ks) == [k in self.model for k in ks]

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def evict(self, ks: list[bytes]) -> None:
        present = [k for k in ks if k in self.model]
        assert self.tier.evict(ks) == len(present)
        for k in present:
            del self.model[k]
            self.corrupt.discard(k)

    @precondition(lambda self: bool(set(self.model) - self.corrupt))
    @rule(data=st.data())
    def corrupt_payload(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(set(self.model) - self.corrupt)))
        pos = data.draw(st.integers(0, ODD_FMT.payload_bytes - 1))
        slot = self.tier.slot_of(k)
        assert slot is not None
        flip_file_byte(self.tier.file, self.tier.slot_offset(slot) + HEADER_BYTES + pos)
        self.corrupt.add(k)

    @rule()
    def reopen(self) -> None:
        self.tier.close()
        self.tier = DiskTier(self.dir, capacity(ODD_FMT, CAP), ODD_FMT, io_threads=2)
        # after a restart the LRU order is the write order
        order = sorted(self.model, key=self.written.__getitem__)
        self.model = OrderedDict((k, self.model[k]) for k in order)

    @invariant()
    def consistent(self) -> None:
        assert self.tier.held_keys() == list(self.model)
        self.tier.check_consistency()
        assert self.tier.stats()["io_errors"] == 0

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DiskTierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_disk_tier_state_machine = DiskTierMachine.TestCase


def test_buffered_io(tmp_path: Path) -> None:
    """direct=False (what a file system without O_DIRECT gets): same behaviour, page cache."""
    tier = DiskTier(tmp_path, capacity(ODD_FMT, 4), ODD_FMT, direct=False)
    assert tier.stats()["direct_io"] == 0
    keys = [key(i) for i in range(3)]
    assert tier.put(keys, [block(k, ODD_FMT) for k in keys]) == [True] * 3
    flip_file_byte(tier.file, tier.slot_offset(tier.slot_of(keys[1]) or 0) + HEADER_BYTES + 7)
    bufs = outs(3, ODD_FMT)
    assert tier.get(keys, bufs) == [True, False, True]
    np.testing.assert_array_equal(bufs[2], block(keys[2], ODD_FMT))
    assert tier.stats()["corrupted_blocks"] == 1
    tier.close()


def test_stats_report_every_documented_key_from_the_start(tmp_path: Path) -> None:
    """stats() promises recreated_files, scanned_slots and recovered_blocks; a new (and an
    unavailable) tier left them out."""
    documented = ("recreated_files", "scanned_slots", "recovered_blocks", "preallocated")
    tier = DiskTier(tmp_path / "new", capacity(FMT, 2), FMT)
    assert {k: tier.stats().get(k) for k in documented} == dict.fromkeys(documented, 0) | {
        "preallocated": 1
    }
    tier.close()
    (tmp_path / "file").write_bytes(b"")
    down = DiskTier(tmp_path / "file" / "tier", capacity(FMT, 2), FMT)  # unavailable
    assert down.stats()["unavailable"] == 1
    assert all(down.stats().get(k) == 0 for k in documented)
    down.close()


def test_a_strided_buffer_is_refused_before_a_slot_is_taken(tmp_path: Path) -> None:
    """A strided 1-D memoryview passed byte_view, then raised BufferError inside the I/O after
    put had taken (evicting) a slot and get had counted a reader: both leaked for good. Now it
    is a ValueError naming the fix, and nothing changes."""
    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)
    held = [key(0), key(1)]
    assert tier.put(held, [block(k) for k in held]) == [True, True]  # full
    strided = memoryview(bytearray(2 * FMT.payload_bytes))[::2]
    assert strided.nbytes == FMT.payload_bytes and not strided.c_contiguous
    with pytest.raises(ValueError, match=r"payloads\[i\] must be C-contiguous.*ascontiguousarray"):
        tier.put([key(2)], [strided])
    with pytest.raises(ValueError, match=r"outs\[i\] must be C-contiguous.*strides \(2,\)"):
        tier.get([key(0)], [strided])
    s = tier.stats()
    assert tier.held_keys() == held and (s["blocks"], s["evictions"], s["hits"]) == (2, 0, 0)
    tier.check_consistency()
    assert tier.evict([key(0)]) == 1  # no reader left on its slot: freed at once
    assert tier.put([key(2), key(3)], [block(key(2)), block(key(3))]) == [True, True]
    bufs = outs(2)
    assert tier.get([key(2), key(3)], bufs) == [True, True]
    np.testing.assert_array_equal(bufs[1], block(key(3)))
    tier.check_consistency()
    tier.close()


def test_a_buffer_that_cannot_be_mapped_is_a_miss_or_a_drop(tmp_path: Path) -> None:
    """An mmap of a bounce or header buffer that fails (ENOMEM) is an I/O condition: get misses
    and put drops (counted), nothing raises and no slot is lost."""
    import errno

    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT, direct=False)  # runs form on any buffer
    keys = [key(i) for i in range(4)]
    assert tier.put(keys[:2], [block(k) for k in keys[:2]]) == [True, True]

    def no_memory(*args: object) -> memoryview:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    tier._bounce = no_memory  # type: ignore[method-assign]
    tier._run_headers = no_memory  # type: ignore[method-assign]
    assert tier.get(keys[:1], outs(1)) == [False]  # one block: the bounce buffer
    assert tier.get(keys[1:2], outs(1)) == [False]
    assert tier.put(keys[2:], [block(k) for k in keys[2:]]) == [False, False]  # a run of two
    del tier._bounce, tier._run_headers
    s = tier.stats()
    assert (s["misses"], s["writes_dropped"], s["io_errors"], s["blocks_written"]) == (2, 2, 4, 2)
    tier.check_consistency()
    assert tier.put(keys, [block(k) for k in keys]) == [True] * 4  # every slot is free again
    tier.close()


def test_an_exception_in_the_io_gives_every_slot_back(tmp_path: Path) -> None:
    """Any exception raised while blocks are read or written (a bug, not an I/O condition)
    propagates, and the reader count / the slot taken is given back: before, the slot being
    read could never be evicted or freed again, and the slot being written was lost."""
    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)
    held = [key(0), key(1)]
    assert tier.put(held, [block(k) for k in held]) == [True, True]

    def bug(run: object) -> list[str | None]:
        raise RuntimeError("a bug in the I/O")

    tier._read_run = bug  # type: ignore[method-assign]
    bufs = outs(1)
    with pytest.raises(RuntimeError, match="a bug in the I/O"):
        tier.get(held[:1], bufs)
    del tier._read_run
    assert tier.held_keys() == [key(1), key(0)]  # not dropped: the block itself is fine
    assert (tier.stats()["hits"], tier.stats()["misses"]) == (0, 1)
    assert tier.evict(held[:1]) == 1
    assert tier.put([key(2)], [block(key(2))]) == [True]  # key 0's slot was freed at once
    tier.check_consistency()

    tier._write_run = bug  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a bug in the I/O"):
        tier.put([key(3)], [block(key(3))])  # takes key 1's slot (LRU) and fails
    del tier._write_run
    assert tier.held_keys() == [key(2)] and tier.stats()["blocks"] == 1
    assert tier.contains([key(3)]) == [False]
    tier.check_consistency()
    new = [key(4), key(5)]
    assert tier.put(new, [block(k) for k in new]) == [True, True]  # both slots usable
    tier.check_consistency()
    tier.close()


def test_a_put_that_loses_its_block_counts_no_write_twice(tmp_path: Path) -> None:
    """A put whose block a clear() overtook was counted in blocks_written / bytes_written and
    in writes_dropped; a put that a concurrent put of the same key beat answers True (held)
    and is counted once, as written."""
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    write_run = tier._write_run

    def write_then_clear(run):  # type: ignore[no-untyped-def]
        errors = write_run(run)
        tier.clear()
        return errors

    tier._write_run = write_then_clear  # type: ignore[method-assign]
    assert tier.put([key(1)], [block(key(1))]) == [False]
    del tier._write_run
    s = tier.stats()
    assert (s["blocks_written"], s["bytes_written"], s["writes_dropped"]) == (0, 0, 1)

    def write_while_another_puts(run):  # type: ignore[no-untyped-def]
        del tier._write_run  # the other put writes as usual, and wins
        assert tier.put([key(2)], [block(key(2), version=1)]) == [True]
        return write_run(run)

    tier._write_run = write_while_another_puts  # type: ignore[method-assign]
    assert tier.put([key(2)], [block(key(2))]) == [True]  # held: the other put's block
    s = tier.stats()
    slot_bytes = HEADER_BYTES + FMT.payload_bytes
    assert (s["blocks_written"], s["bytes_written"], s["writes_dropped"]) == (2, 2 * slot_bytes, 1)
    assert s["blocks"] == 1
    bufs = outs(1)
    assert tier.get([key(2)], bufs) == [True]
    np.testing.assert_array_equal(bufs[0], block(key(2), version=1))
    tier.check_consistency()
    tier.close()


def test_a_get_overlapping_clear_serves_no_block_from_before_it(tmp_path: Path) -> None:
    """clear() returning while a get was reading: the get served the pre-clear block after
    clear() had returned (stale KV after a weight change)."""
    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)
    keys = [key(1), key(2)]
    assert tier.put(keys, [block(k) for k in keys]) == [True, True]
    read_run = tier._read_run
    cleared: list[int] = []

    def read_then_clear(run):  # type: ignore[no-untyped-def]
        reasons = read_run(run)  # the bytes are read and verified...
        if not cleared:  # (one run per block here: unaligned outputs)
            cleared.append(tier.clear())  # ...and a cache reset returns meanwhile
        return reasons

    tier._read_run = read_then_clear  # type: ignore[method-assign]
    assert tier.get(keys, outs(2)) == [False, False]
    del tier._read_run
    assert cleared == [2]
    s = tier.stats()
    assert (s["hits"], s["misses"], s["corrupted_blocks"], s["blocks"]) == (0, 2, 0, 0)
    tier.check_consistency()  # the slots read were freed when the reads ended
    assert tier.put(keys, [block(k, version=1) for k in keys]) == [True, True]  # no eviction
    assert tier.stats()["evictions"] == 2  # the two the clear dropped, none since
    tier.close()


def test_a_put_begun_before_clear_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put that began before a clear() (here: the clear lands while the put checks its
    payloads) read the clear count too late and stored its pre-reset block."""
    import kvoff.tiers.disk as disk_mod

    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)
    real = disk_mod.byte_view
    calls: list[int] = []

    def clear_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not calls:
            calls.append(tier.clear())
        return real(*args, **kwargs)

    monkeypatch.setattr(disk_mod, "byte_view", clear_first)
    assert tier.put([key(1)], [block(key(1))]) == [False]
    assert calls == [0]
    assert tier.contains([key(1)]) == [False] and tier.get([key(1)], outs(1)) == [False]
    s = tier.stats()
    assert (s["blocks_written"], s["writes_dropped"], s["blocks"]) == (0, 1, 0)
    assert tier.put([key(1)], [block(key(1))]) == [True]  # a put after the clear is stored
    tier.check_consistency()
    tier.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")
def test_a_tier_dropped_without_close_releases_its_file(tmp_path: Path) -> None:
    """A DiskTier garbage-collected without close() kept its descriptor and flock until the
    process ended: the same path could not be opened again."""
    import gc

    gc.collect()  # tiers other tests dropped
    before = open_fds()
    DiskTier(tmp_path, capacity(FMT, 2), FMT).put([key(1)], [block(key(1))])
    gc.collect()
    assert open_fds() == before
    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)  # not "in use by another DiskTier"
    assert tier.contains([key(1)]) == [True]
    tier.close()
