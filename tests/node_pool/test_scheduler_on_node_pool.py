"""kvoff's C++ scheduler (the one KvoffConnector runs) on a node pool: two simulated engines,
each with its own scheduler and worker, share one pool. Bytes move through the pool's region
and the harness checks every loaded byte (tests/scheduler_harness.py)."""

from __future__ import annotations

import os

import pytest
from node_pool_harness import SIM_SLOTS, Served, age_leases, sim_engine, start_pool_process
from scheduler_harness import EngineSim

from kvoff.node_pool import NodePoolClient, NodePoolError
from kvoff.node_pool.client import LEASE_HELD_SHARE, LOSS_LOAD_MAX_S


def _pins_and_pending(pool: Served, *engines: EngineSim) -> tuple[int, int]:
    """Blocks pinned by loads and pending stores in the pool, once it has had every call of
    ``engines`` (completions go without a reply)."""
    for e in engines:
        e.sched.node_pool.sync()

    def counts(srv) -> tuple[int, int]:
        st = srv.status()
        return sum(e["pinned_blocks"] for e in st["engines"]), st["pending_blocks"]

    return pool.call(counts)


def test_a_block_one_engine_stored_is_a_hit_with_its_bytes_for_another(pool: Served) -> None:
    a, b = sim_engine(pool, "a"), sim_engine(pool, "b")
    prompt = list(range(13))
    a.add_request("r", prompt)
    rec = a.step()
    (store,) = rec.meta.store_jobs
    assert all(a.sched.block_state(k) == "ready" for k in store.keys)

    b.add_request("r", prompt)
    rec = b.step()
    assert rec.lookups == {"r": (0, 12)}  # every full block of the prompt, stored by a
    (load,) = rec.meta.load_jobs
    assert load.keys == store.keys  # the same layout: the same keys
    assert load.cpu.block_ids == store.cpu.block_ids  # read from the slots a wrote
    assert rec.outputs[-1].finished_loading == ("r",)  # and the harness checked the bytes
    assert b.ready_keys >= set(store.keys)  # a's stores are b's events too
    a.drain()
    b.drain()
    assert b.sched.stats()["hit_tokens"] == 12
    assert _pins_and_pending(pool, a, b) == (0, 0)  # every pin and store of both ended


def test_stores_into_reserved_slots_carry_the_bytes_to_another_engine(pool: Served) -> None:
    """KvoffConnector's scheduler on a node pool stores a request's new blocks into the slots
    the pool reserved for it, with no round trip; another engine loads those bytes."""
    a, b = sim_engine(pool, "a"), sim_engine(pool, "b")
    a.add_request("first", list(range(100, 109)))  # asks the pool, which grants a reservation
    a.drain()
    client = a.sched.node_pool
    before = client.stores_on_reservation
    prompt = list(range(9))
    a.add_request("r", prompt)
    (store,) = a.step().meta.store_jobs
    assert client.stores_on_reservation == before + 1  # (look-ups, events still ask the pool)
    a.drain()
    b.add_request("r", prompt)
    rec = b.step()
    assert rec.lookups == {"r": (0, 8)}
    (load,) = rec.meta.load_jobs
    assert load.cpu.block_ids == store.cpu.block_ids
    assert rec.outputs[-1].finished_loading == ("r",)  # and the harness checked the bytes


def test_a_block_another_engine_is_storing_is_retried_then_hit(pool: Served) -> None:
    a = sim_engine(pool, "a", auto_complete=False)
    b = sim_engine(pool, "b", auto_complete=False)
    prompt = list(range(9))
    a.add_request("r", prompt)
    (store,) = a.step().meta.store_jobs
    b.add_request("r", prompt)
    assert b.step().lookups == {"r": (0, None)}  # pending in the pool: retry later
    a.complete()
    rec = b.step()
    assert rec.lookups == {"r": (0, 8)}
    (load,) = rec.meta.load_jobs
    assert load.cpu.block_ids == store.cpu.block_ids
    assert b.sched.pin_count(load.keys[0]) == 1  # this engine's load pins it
    assert b.sched.cpu_block_id(load.keys[0]) == load.cpu.block_ids[0]
    assert _pins_and_pending(pool, a, b) == (2, 0)
    b.complete()
    b.drain()
    a.drain()
    assert _pins_and_pending(pool, a, b) == (0, 0)


def test_a_pool_that_is_gone_is_a_miss_and_no_error(pool: Served) -> None:
    a, b = sim_engine(pool, "a"), sim_engine(pool, "b")
    prompt = list(range(13))
    a.add_request("r", prompt)
    a.drain()
    pool.stop()
    b.add_request("r", prompt)
    rec = b.step()
    assert rec.lookups == {"r": (0, 0)}  # recomputed, not an error
    assert rec.meta.store_jobs == ()  # no room in a pool that is gone: nothing stored
    b.drain()
    assert b.sched.stats()["store_refusals"] >= 1


def test_the_pool_keeps_its_own_tiers_and_counts(pool: Served) -> None:
    a = sim_engine(pool, "a")
    with pytest.raises(ValueError, match="node pool: its tiers are the pool's"):
        a.sched.attach_tiers([], lambda slot: a.worker.cpu_block(slot).numpy())
    assert "num_free_blocks" not in a.sched.stats()  # the pool's counts: kvoff pool status
    n, pinned, pending = a.sched.pool_usage()
    assert (n, pinned, pending) == (SIM_SLOTS, 0, 0)


def test_usage_gauges_do_not_count_reserved_slots_as_in_use(pool: Served) -> None:
    """vLLM's ``cpu_cache_usage_perc`` is the share of blocks transfers pin: an engine's
    reserved slots (held for stores that need no reply) are not in use until a store takes
    them, so a drained engine with a reservation reads 0."""
    a = sim_engine(pool, "a")
    a.add_request("r", list(range(13)))
    a.drain()  # its stores done: the reservation is topped up for the next ones
    counts = pool.call(lambda s: s.counts())
    assert counts["reserved_blocks"] > 0 and counts["pending_blocks"] == 0
    n, pinned, pending = a.sched.pool_usage()
    assert (n, pinned, pending) == (SIM_SLOTS, 0, 0)


def test_a_spec_of_another_size_than_the_pool_is_refused(pool: Served) -> None:
    client = NodePoolClient(pool.socket, b"sim-layout", name="x")
    with pytest.raises(ValueError, match=f"has {SIM_SLOTS} slots but the spec has 8"):
        EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, node_pool=client)


def test_a_flag_that_is_no_bool_is_refused_before_the_pool_is_asked(pool: Served) -> None:
    """``enable_events="no"`` would be true for ``if enable_events``: the scheduler subscribed
    the client to the pool's events and then failed in the core. The flags are checked first,
    so a refused scheduler leaves its client as it was."""
    client = NodePoolClient(pool.socket, b"sim-layout", name="x")
    with pytest.raises(TypeError, match=r"enable_events must be a bool \(True or False\), got str"):
        EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=SIM_SLOTS, node_pool=client,
                  enable_events="no")  # fmt: skip
    assert not client._events_on  # not subscribed
    EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=SIM_SLOTS, node_pool=client)
    assert client._events_on  # the harness's default, enable_events=True


@pytest.mark.parametrize("lookahead", [256, 0], ids=["look-ahead", "no-look-ahead"])
@pytest.mark.parametrize("lease_age", [0.0, 0.6], ids=["fresh-lease", "lease-past-half"])
def test_a_leased_hit_loads_its_bytes_when_the_pool_goes_away_before_the_load(
    pool: Served, lease_age: float, lookahead: int
) -> None:
    """The pool goes away between a request's look-up (a hit, leased to this engine) and the
    pin of its load: the pool held the lease when it died, so the load goes on from the leased
    slots, and the harness checks that every loaded byte is the block's. Both pin paths: a
    lease younger than lease_s / 2 (the pin needs no reply) and one past it (the pin waits for
    the pool's reply and finds it gone; without this, KvoffOffloadingSpec's prepare_load
    raised: vLLM's OffloadingConnector has no failed-load path). Look-ups without look-ahead
    (one key per round trip) lease their hits as well."""
    a, b = sim_engine(pool, "a"), sim_engine(pool, "b")
    prompt = list(range(13))
    a.add_request("r", prompt)
    a.drain()
    client = b.sched.node_pool
    client.lookahead = lookahead
    # 0.1 s of room for the time between ageing the lease and its pin
    held_until = min(LEASE_HELD_SHARE * client.lease_s, LOSS_LOAD_MAX_S) - 0.1
    assert lease_age * client.lease_s < held_until
    lookup = b.sched.get_num_new_matched_tokens

    def lookup_then_stop(req, computed):
        out = lookup(req, computed)
        pool.stop()  # gone after the look-up, before the load's pin
        age_leases(client, lease_age)
        return out

    b.sched.get_num_new_matched_tokens = lookup_then_stop
    b.add_request("r", prompt)
    rec = b.step()
    assert rec.lookups == {"r": (0, 12)}
    (load,) = rec.meta.load_jobs
    assert rec.outputs[-1].finished_loading == ("r",)  # the harness checked the bytes
    assert client.loads_after_loss == 1 and client.loads_on_lease == 0 and not client.attached
    b.drain()
    assert b.sched.stats()["hit_tokens"] == 12 and b.sched.pin_count(load.keys[0]) == 0


def test_a_lease_the_pool_may_have_let_lapse_is_not_loaded_when_the_pool_is_gone(
    pool: Served,
) -> None:
    """The same with a lease past LEASE_HELD_SHARE of lease_s: the pool may have let it lapse
    and evicted the block before it died, so the pin raises and changes nothing."""
    a, b = sim_engine(pool, "a"), sim_engine(pool, "b")
    prompt = list(range(13))
    a.add_request("r", prompt)
    a.drain()
    client = b.sched.node_pool
    b.add_request("r", prompt)
    req = b.requests["r"].req
    assert b.sched.get_num_new_matched_tokens(req, 0) == (12, True)
    before = b.sched.stats()
    pool.stop()
    age_leases(client, LEASE_HELD_SHARE + 0.05)
    with pytest.raises(NodePoolError, match="the node pool is gone"):
        b.sched.update_state_after_alloc(req, [[1, 2, 3, 4]], 12)
    assert b.sched.stats() == before and b.sched.pin_count(a.key_of("r", 0)) == 0
    assert client.loads_after_loss == 0
    b.sched.update_state_after_alloc(req, (), 0)  # loads nothing: KvoffConnector recomputes it
    assert b.sched.stats()["load_jobs"] == 0


def test_a_slot_a_restarted_pool_hands_out_again_never_stands_for_two_keys(tmp_path) -> None:
    """The pool is killed while this engine writes a store and restarts on the same region
    with an empty index: its first slots are the ones still being written. That store is
    refused (retried), so the old job's completion cannot end it; the retry stores."""
    import signal
    import time

    from kvoff.node_pool.block_manager import NodePoolBlockManager

    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-np-slots-{os.getpid()}"

    def start():
        return start_pool_process(sock, region, 8)

    old, new = [b"old-key-%d" % i for i in range(2)], [b"new-key-%d" % i for i in range(2)]
    server = start()
    try:
        m = NodePoolBlockManager(NodePoolClient(sock, b"layout", retry_s=0.05, lookahead_s=0))
        _, writing, _ = m.prepare_store(old)  # the worker is writing these slots
        server.send_signal(signal.SIGKILL)
        server.wait()
        assert m.states(old) == b"\0"  # gone: a miss
        server = start()  # adopts the region, with an empty index
        time.sleep(0.1)  # past retry_s
        assert m.prepare_store(new) is None and m.stores_refused_in_flight == 1
        m.complete_store_blocks(writing, True)  # the old store ends: nothing becomes a hit
        assert [m.block_state(k) for k in old + new] == ["missing"] * 4
        _, slots, _ = m.prepare_store(new)  # retried: stored
        m.complete_store_blocks(slots, True)
        assert [m.block_state(k) for k in new] == ["ready"] * 2
    finally:
        server.terminate()
        server.wait()
