"""CPUOffloadingManager against a model: hypothesis state machines, one per registered eviction
policy, that run random calls on the manager and on a small pure-Python model of the manager and
of the policy, and compare every answer, every eviction and the pool's counts (docs/design.md
invariants 6, 7 and 8)."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvoff import CPUOffloadingManager, OffloadingEvent

READY, PENDING = "ready", "pending"


@dataclass
class _Block:
    state: str
    block_id: int
    pins: int = 0


def _key_bytes(k: int | bytes) -> bytes:
    if isinstance(k, bytes):
        return k
    return (k % 2**64).to_bytes(8, "little")


class LRUModel:
    """LRU: one OrderedDict from least to most recent."""

    def __init__(self, num_blocks: int) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, k: bytes) -> None:
        self.order[k] = None

    def touch(self, k: bytes) -> None:
        self.order.move_to_end(k)

    touch_pending = touch

    def erase(self, k: bytes, evicted: bool) -> None:
        del self.order[k]

    def victims(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        return [k for k in self.order if can_evict(k)][:count]


class ARCModel:
    """ARC as eviction_policy.h specifies it: T1/T2 resident and B1/B2 ghost OrderedDicts (least
    recent first; ghosts by key, where the core stores 64-bit key hashes) and the target p."""

    def __init__(self, num_blocks: int) -> None:
        self.c = num_blocks
        self.p = 0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, k: bytes) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if k in b1:
            self.p = min(self.c, self.p + max(1, len(b2) // len(b1)))
            del b1[k]
            t2[k] = None
        elif k in b2:
            self.p = max(0, self.p - max(1, len(b1) // len(b2)))
            del b2[k]
            t2[k] = None
        else:
            while len(t1) + len(b1) >= self.c and b1:
                b1.popitem(last=False)
            while len(t1) + len(t2) + len(b1) + len(b2) >= 2 * self.c and (b1 or b2):
                (b2 if b2 else b1).popitem(last=False)
            t1[k] = None
        self.check_bounds()

    def touch(self, k: bytes) -> None:
        (self.t1 if k in self.t1 else self.t2).pop(k)
        self.t2[k] = None

    def touch_pending(self, k: bytes) -> None:
        # a block used by the request storing it is seen once: most recent of its own list
        lst = self.t1 if k in self.t1 else self.t2
        lst.pop(k)
        lst[k] = None

    def erase(self, k: bytes, evicted: bool) -> None:
        from_t1 = k in self.t1
        (self.t1 if from_t1 else self.t2).pop(k)
        if evicted:
            self.b1.pop(k, None)
            self.b2.pop(k, None)
            (self.b1 if from_t1 else self.b2)[k] = None
        self.check_bounds()

    def victims(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """By definition: what erase(victim, evicted=True) calls one after another evict."""
        sim = copy.deepcopy(self)
        out: list[bytes] = []
        while len(out) < count:
            lists = (sim.t1, sim.t2) if len(sim.t1) > sim.p else (sim.t2, sim.t1)
            victim = next((k for lst in lists for k in lst if can_evict(k)), None)
            if victim is None:
                break
            sim.erase(victim, True)
            out.append(victim)
        return out

    def check_bounds(self) -> None:
        assert 0 <= self.p <= self.c
        assert len(self.t1) + len(self.t2) <= self.c
        assert len(self.t1) + len(self.b1) <= self.c
        assert len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) <= 2 * self.c


class ProbationModel:
    """Probation as eviction_policy.h specifies it: probation and protected OrderedDicts (least
    recent first) ordered by a clock, the budget b, and the ghost table: per set (from
    ``_scheduler._probation_ghost_set``) and list up to 8 (tag, eviction number) ways, replaced as
    the header says. For pools below 8192 slots an eviction epoch is one eviction."""

    WAYS = 8

    def __init__(self, num_blocks: int) -> None:
        from kvoff import _scheduler

        self.c = num_blocks
        self.w = -(-num_blocks // 4)
        self.d = -(-num_blocks // self.w)
        self.b = num_blocks
        self.clock = 0
        self.stamp: dict[bytes, int] = {}
        self.lists: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (
            OrderedDict(),  # probation
            OrderedDict(),  # protected
        )
        self.ghosts: dict[tuple[int, int], list[list[int]]] = {}  # (set, list) -> [tag, number]
        self.evictions = [0, 0]
        self._where = lambda k: _scheduler._probation_ghost_set(k, num_blocks)[:2]

    def _link(self, k: bytes, lst: int) -> None:
        self.clock += 1
        self.stamp[k] = self.clock
        self.lists[lst][k] = None

    def _list_of(self, k: bytes) -> int:
        return 0 if k in self.lists[0] else 1

    def insert(self, k: bytes) -> None:
        set_index, tag = self._where(k)
        dest = 0
        for lst in (0, 1):
            for way in self.ghosts.get((set_index, lst), []):
                if way[0] != tag:
                    continue
                way[0] = 0
                age = (self.evictions[lst] - way[1]) % 2**16
                if age >= 2 * self.c:
                    continue
                if age < self.w:
                    self.b = min(self.c, self.b + self.d) if lst == 0 else max(0, self.b - self.d)
                dest = 1
        self._link(k, dest)

    def touch(self, k: bytes) -> None:
        del self.lists[self._list_of(k)][k]
        self._link(k, 1)

    def touch_pending(self, k: bytes) -> None:
        lst = self._list_of(k)
        del self.lists[lst][k]
        self._link(k, lst)

    def erase(self, k: bytes, evicted: bool) -> None:
        lst = self._list_of(k)
        del self.lists[lst][k]
        del self.stamp[k]
        if not evicted:
            return
        self.evictions[lst] += 1
        now = self.evictions[lst]
        set_index, tag = self._where(k)
        ways = self.ghosts.setdefault((set_index, lst), [[0, 0] for _ in range(self.WAYS)])
        pick, oldest = 0, -1
        for i, (t, number) in enumerate(ways):
            if t == tag:
                pick = i
                break
            age = 2**16 if t == 0 else (now - number) % 2**16
            if age > oldest:
                pick, oldest = i, age
        ways[pick] = [tag, now]

    def victims(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """By definition: what erase(victim, evicted=True) calls one after another evict."""
        sim = copy.deepcopy(self)
        sim._where = self._where
        out: list[bytes] = []
        while len(out) < count:
            heads = [next((k for k in lst if can_evict(k)), None) for lst in sim.lists]
            p, r = heads
            # over the budget probation goes first; otherwise the older of the two (global LRU)
            over_budget = len(sim.lists[0]) > sim.b
            take_p = p is not None and (over_budget or r is None or sim.stamp[p] < sim.stamp[r])
            victim = p if take_p else r
            if victim is None:
                break
            sim.erase(victim, True)
            out.append(victim)
        return out

    def check_bounds(self) -> None:
        assert 0 <= self.b <= self.c
        assert len(self.lists[0]) + len(self.lists[1]) <= self.c


POLICY_MODELS = {"lru": LRUModel, "arc": ARCModel, "probation": ProbationModel}


class Model:
    """The manager's semantics in plain Python, with a model of its eviction policy."""

    def __init__(self, num_blocks: int, enable_events: bool, policy: str = "lru") -> None:
        self.num_blocks = num_blocks
        self.enable_events = enable_events
        self.blocks: dict[bytes, _Block] = {}
        self.policy = POLICY_MODELS[policy](num_blocks)
        self.events: list[OffloadingEvent] = []

    def num(self, state: str) -> int:
        return sum(b.state == state for b in self.blocks.values())

    def lookup(self, keys: list[bytes]) -> int | None:
        hits = 0
        for k in keys:
            b = self.blocks.get(k)
            if b is None:
                break
            if b.state != READY:
                return None
            hits += 1
        return hits

    def can_load(self, keys: list[bytes]) -> bool:
        return all(k in self.blocks and self.blocks[k].state == READY for k in keys)

    def can_unload(self, keys: list[bytes]) -> bool:
        return self.can_load(keys) and all(
            self.blocks[k].pins >= n for k, n in Counter(keys).items()
        )

    def can_complete_store(self, keys: list[bytes]) -> bool:
        return all(k in self.blocks and self.blocks[k].state == PENDING for k in keys)

    def touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            b = self.blocks.get(k)
            if b is None:
                continue
            if b.state == PENDING:
                self.policy.touch_pending(k)
            else:
                self.policy.touch(k)

    def prepare_store(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]] | None:
        new = list(dict.fromkeys(k for k in keys if k not in self.blocks))
        free = self.num_blocks - len(self.blocks)
        evicted: list[bytes] = []
        if len(new) > free:
            call = set(keys)

            def can_evict(k: bytes) -> bool:
                b = self.blocks[k]
                return b.state == READY and b.pins == 0 and k not in call

            evicted = self.policy.victims(len(new) - free, can_evict)
            if len(evicted) < len(new) - free:
                return None
        for k in evicted:
            del self.blocks[k]
            self.policy.erase(k, True)
        if evicted and self.enable_events:
            self.events.append(OffloadingEvent(evicted, "CPU", True))
        return new, evicted

    def add_pending(self, keys: list[bytes], block_ids: list[int]) -> None:
        for k, bid in reversed(list(zip(keys, block_ids, strict=True))):
            self.blocks[k] = _Block(PENDING, bid)
            self.policy.insert(k)  # last to first: keys[0] ends most recent

    def complete_store(self, keys: list[bytes], success: bool) -> None:
        done = list(dict.fromkeys(keys))
        for k in done:
            if success:
                self.blocks[k].state = READY
            else:
                del self.blocks[k]
                self.policy.erase(k, False)
        if success and done and self.enable_events:
            self.events.append(OffloadingEvent(done, "CPU", False))


KEY_UNIVERSE = [b"k0", b"k1", b"k2", b"\x00", 3, 4, -1, 2**64 - 2, b"k8", b"k9", 10, b"long" * 10]
key_st = st.sampled_from(KEY_UNIVERSE)
keys_st = st.lists(key_st, max_size=6)
# arguments that are no list of keys (a single key, a set, None, an item of another type, an
# empty key, an int beyond 64 bits) and flags that are no bool
BAD_KEY_LISTS = [None, b"k0", {b"k0"}, 1.5, [None], [b"k0", None], [b"k0", 1.5], [b""], [2**64]]
BAD_FLAGS = [None, 0, 1, "False", 1.0, [True]]


class ManagerMachine(RuleBasedStateMachine):
    """Random operation sequences on CPUOffloadingManager and Model give the same results:
    lookups, keys to store, block ids, eviction order (evicted_keys), events, states and
    counters, checked after every step."""

    POLICY = "lru"

    @initialize(num_blocks=st.integers(1, 6), enable_events=st.booleans())
    def setup(self, num_blocks: int, enable_events: bool) -> None:
        self.m = CPUOffloadingManager(num_blocks, self.POLICY, enable_events)
        assert self.m.eviction_policy == self.POLICY
        self.model = Model(num_blocks, enable_events, self.POLICY)
        self.loads: list[list[bytes]] = []  # in-flight prepare_load batches
        self.stores: list[list[bytes]] = []  # in-flight prepare_store batches
        self.evicted: list[bytes] = []  # the latest evicted keys, most recent last

    # -- queries
    @rule(keys=keys_st)
    def lookup(self, keys):
        assert self.m.lookup(keys) == self.model.lookup([_key_bytes(k) for k in keys])

    @rule(keys=keys_st)
    def touch(self, keys):
        self.m.touch(keys)
        self.model.touch([_key_bytes(k) for k in keys])

    @rule(perm=st.permutations(KEY_UNIVERSE))
    def touch_held(self, perm):
        # Touches every held key at once (for ARC: empties T1, so the next evictions come from
        # T2 in this call's order).
        keys = [k for k in perm if _key_bytes(k) in self.model.blocks]
        self.m.touch(keys)
        self.model.touch([_key_bytes(k) for k in keys])

    # -- loads
    @rule(keys=keys_st, hits_only=st.booleans())
    def prepare_load(self, keys, hits_only):
        kb = [_key_bytes(k) for k in keys]
        if hits_only:  # load what lookup reports, as a scheduler does
            n = self.model.lookup(kb) or 0
            keys, kb = keys[:n], kb[:n]
        if self.model.can_load(kb):
            ids = self.m.prepare_load(keys)
            assert ids == [self.model.blocks[k].block_id for k in kb]
            for k in kb:
                self.model.blocks[k].pins += 1
            self.loads.append(kb)
        else:
            with pytest.raises(ValueError):
                self.m.prepare_load(keys)

    @rule(i=st.integers(0, 100))
    def complete_load(self, i):
        if not self.loads:
            return
        kb = self.loads.pop(i % len(self.loads))
        self.m.complete_load(kb)
        for k in kb:
            self.model.blocks[k].pins -= 1

    @rule(keys=keys_st)
    def complete_load_arbitrary(self, keys):
        kb = [_key_bytes(k) for k in keys]
        if self.model.can_unload(kb) and kb:
            return  # would be valid; in-flight loads are finished by complete_load
        if not kb:
            self.m.complete_load([])
            return
        with pytest.raises(ValueError):
            self.m.complete_load(keys)

    # -- stores
    @rule(keys=keys_st)
    def prepare_store(self, keys):
        kb = [_key_bytes(k) for k in keys]
        out = self.m.prepare_store(keys)
        expected = self.model.prepare_store(kb)
        if expected is None:
            assert out is None
            return
        assert out is not None
        new, evicted = expected
        assert out.keys_to_store == new
        assert out.evicted_keys == evicted
        assert len(out.block_ids) == len(new)
        assert len(set(out.block_ids)) == len(new)
        held = {b.block_id for b in self.model.blocks.values()}
        assert all(0 <= b < self.model.num_blocks and b not in held for b in out.block_ids)
        self.model.add_pending(new, out.block_ids)
        if new:
            self.stores.append(new)
        self.evicted = (self.evicted + list(out.evicted_keys))[-4:]

    @rule(keys=keys_st.filter(bool))
    def request(self, keys):
        # A request as the replay serves one: look up, touch, store the blocks after the hits,
        # touch again (the new blocks are pending then), and finish the store.
        kb = [_key_bytes(k) for k in keys]
        if len(set(kb)) != len(kb):
            return
        hits = self.model.lookup(kb)
        assert self.m.lookup(keys) == hits
        if hits is None:
            return
        self.touch(keys)
        n_stores = len(self.stores)
        self.prepare_store(keys[hits:])
        self.touch(keys)
        if len(self.stores) > n_stores:
            self.complete_store(len(self.stores) - 1, success=True, repeat=False)

    @rule(i=st.integers(0, 100), success=st.booleans(), repeat=st.booleans())
    def complete_store(self, i, success, repeat):
        if not self.stores:
            return
        kb = self.stores.pop(i % len(self.stores))
        call = kb + kb[:1] if repeat else kb  # a repeated key is finished once
        self.m.complete_store(call, success=success)
        self.model.complete_store(call, success)

    @rule(keys=keys_st.filter(bool), success=st.booleans())
    def complete_store_arbitrary(self, keys, success):
        kb = [_key_bytes(k) for k in keys]
        if self.model.can_complete_store(kb):
            return  # valid: stores are finished by complete_store
        with pytest.raises(ValueError):
            self.m.complete_store(keys, success=success)

    @rule(
        method=st.sampled_from(
            ["lookup", "touch", "prepare_store", "complete_store", "prepare_load", "complete_load"]
        ),
        bad=st.sampled_from(BAD_KEY_LISTS),
    )
    def bad_keys(self, method, bad):
        # A key list that is none: refused, and the invariants below check that nothing
        # changed (states, counts, the policy's order through later evictions).
        with pytest.raises((TypeError, ValueError)):
            getattr(self.m, method)(bad)

    @rule(
        flag=st.sampled_from(["success", "write_through", "apply_threshold"]),
        bad=st.sampled_from(BAD_FLAGS),
        i=st.integers(0, 100),
        keys=keys_st,
    )
    def bad_flag(self, flag, bad, i, keys):
        # A flag that is no bool, on a call that would be valid with True or False (a store in
        # flight, keys to store): refused, nothing changed (None was taken as False, and the
        # stores were dropped).
        if flag == "apply_threshold":
            with pytest.raises(TypeError, match="apply_threshold must be a bool"):
                self.m.prepare_store(keys, apply_threshold=bad)
        elif self.stores:
            kb = self.stores[i % len(self.stores)]
            with pytest.raises(TypeError, match=f"{flag} must be a bool"):
                self.m.complete_store(kb, **{flag: bad})

    @rule()
    def take_events(self):
        assert self.m.take_events() == self.model.events
        self.model.events = []

    # -- after every step
    @invariant()
    def counters_and_states_agree(self):
        model = self.model
        assert self.m.num_free_blocks == model.num_blocks - len(model.blocks)
        assert self.m.num_stored_blocks == model.num(READY)
        assert self.m.num_pending_blocks == model.num(PENDING)
        assert len(self.m) == len(model.blocks)
        for k in KEY_UNIVERSE:
            kb = _key_bytes(k)
            assert (k in self.m) == (kb in model.blocks)
            assert self.m.lookup([k]) == model.lookup([kb])


class ARCManagerMachine(ManagerMachine):
    """The same state machine with eviction_policy="arc" and ARCModel. The key universe is
    larger than the pool, so evicted keys come back as ghost hits and move p both ways."""

    POLICY = "arc"

    @invariant()
    def arc_model_bounds(self):
        policy = self.model.policy
        policy.check_bounds()
        assert set(policy.t1) | set(policy.t2) == set(self.model.blocks)


class ProbationManagerMachine(ManagerMachine):
    """The same state machine with eviction_policy="probation" and ProbationModel: evicted keys
    come back (second sight into protected, the budget moving both ways) and pending keys are
    touched (ordered, never promoted)."""

    POLICY = "probation"

    @rule(i=st.integers(0, 3), touch_after=st.booleans())
    def store_again(self, i, touch_after):
        # Stores a key that was just evicted (a ghost hit young enough to move the budget), then
        # maybe touches it while pending, as a request storing it does.
        if not self.evicted:
            return
        key = self.evicted[-1 - i % len(self.evicted)]
        self.prepare_store([key])
        if touch_after:
            self.touch([key])

    @invariant()
    def probation_model_bounds(self):
        policy = self.model.policy
        policy.check_bounds()
        assert set(policy.lists[0]) | set(policy.lists[1]) == set(self.model.blocks)


MACHINES = {"lru": ManagerMachine, "arc": ARCManagerMachine, "probation": ProbationManagerMachine}


def test_every_registered_policy_has_a_model_and_a_machine():
    # Fails when a policy is registered in the C++ core without a model here: the state machine
    # below would not run for it.
    from kvoff import _scheduler

    assert set(_scheduler.eviction_policies()) == set(POLICY_MODELS) == set(MACHINES)


_machine_settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for _machine in MACHINES.values():
    _machine.TestCase.settings = _machine_settings


def _policies() -> list[str]:
    from kvoff import _scheduler

    return list(_scheduler.eviction_policies())


@pytest.mark.parametrize("policy", _policies())
def test_manager_matches_model(policy):
    """Every registered policy: random operation sequences give the manager's and the model's
    results (lookups, keys to store, block ids, eviction order, events, states, counters)."""
    MACHINES[policy].TestCase().runTest()
