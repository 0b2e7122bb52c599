"""Property: plan → registration → CPU sizing agree for random hybrid layouts and world sizes
(docs/design.md invariants 2 and 3): the worker built from a CPUOffloadingSpec registers tensors
allocated exactly as the KVCacheConfig says, sees the same bytes per GPU block as the spec,
allocates the spec's CPU block count, and moves every group's blocks correctly."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoff import CPUBlockSpec, GPUBlockSpec, OffloadingConfig, OffloadingWorker
from kvoff.kv_cache_config import get_kv_cache_config, pool_bytes_per_block
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.sizing import compute_num_cpu_blocks
from kvoff.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec


@st.composite
def layouts(draw):
    bs = draw(st.sampled_from([4, 8, 16]))
    heads = draw(st.integers(1, 2))
    head_size = draw(st.sampled_from([8, 16]))
    full = FullAttentionSpec(bs, heads, head_size, torch.float16)
    kinds = {"full": draw(st.integers(1, 4)), "swa": draw(st.integers(0, 5))}
    kinds["mamba"] = draw(st.integers(0, 2))
    specs = {}
    for i in range(kinds["full"]):
        specs[f"full.{i}"] = full
    for i in range(kinds["swa"]):
        specs[f"swa.{i}"] = SlidingWindowSpec(bs, heads, head_size, torch.float16, 2 * bs)
    page = full.page_size_bytes
    for i in range(kinds["mamba"]):
        # a float32 state of page / 8 elements = half the page, padded to the attention page
        specs[f"mamba.{i}"] = MambaSpec(bs, ((page // 8,),), (torch.float32,), page)
    blocks = draw(st.integers(4, 24)) + len(specs)  # at least one block per group + null
    world_size = draw(st.integers(1, 4))
    factor = draw(st.sampled_from([1, 2]))
    slots = draw(st.integers(1, 6))
    mechanism = draw(st.sampled_from(["auto", "staged"]))
    return specs, blocks, world_size, factor, slots, mechanism


def _layer_views(config, device="cpu"):
    """Allocate every KVCacheTensor and give each layer sharing it a view of it."""
    n = config.num_blocks
    specs = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            specs[name] = group.kv_cache_spec
    views = {}
    for t in config.kv_cache_tensors:
        raw = torch.randint(0, 256, (t.size,), dtype=torch.uint8, device=device)
        for name in t.shared_by:
            spec = specs[name]
            if isinstance(spec, MambaSpec):
                views[name] = raw.view(n, -1)
            else:
                views[name] = raw.view(torch.float16).view(
                    n, 2, spec.block_size, spec.num_kv_heads, spec.head_size
                )
    return views


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_plan_registration_and_cpu_sizing_agree(layout) -> None:
    specs, blocks, world_size, factor, slots, mechanism = layout
    first = get_kv_cache_config(specs, 10**9, num_gpu_blocks_override=blocks)
    per_block = pool_bytes_per_block(first.kv_cache_groups)
    config = get_kv_cache_config(specs, per_block * blocks)  # the same plan from memory
    assert config.num_blocks == blocks
    assert sum(t.size for t in config.kv_cache_tensors) == blocks * per_block
    bs = next(iter(specs.values())).block_size
    cpu_bytes = slots * per_block * factor * world_size + per_block - 1
    spec = CPUOffloadingSpec(
        config, cpu_bytes_to_use=cpu_bytes, block_size=bs * factor, world_size=world_size
    )
    assert spec.kv_bytes_per_block == per_block
    assert spec.num_blocks == compute_num_cpu_blocks(cpu_bytes, per_block, factor, world_size)
    assert spec.num_blocks == slots

    views = _layer_views(config)
    # staged: the staging buffer holds one block per direction, so every block is a piece
    options = OffloadingConfig(
        num_cpu_blocks=slots, transfer_mechanism=mechanism, staging_bytes=2 * per_block
    )
    worker = OffloadingWorker.from_spec(spec, config=options)
    worker.register_kv_caches(views)
    assert worker.num_cpu_blocks == spec.num_blocks
    assert worker.num_groups == len(config.kv_cache_groups)
    padded = any(isinstance(s, MambaSpec) for s in specs.values())
    assert worker.bytes_per_gpu_block <= spec.kv_bytes_per_block
    if not padded:
        assert worker.bytes_per_gpu_block == spec.kv_bytes_per_block

    # each group in turn: store its GPU blocks 1..factor into slot 0, load them into the last
    # `factor` blocks, and check that group's layers (only that group moves in the job)
    groups = len(config.kv_cache_groups)
    for g, group in enumerate(config.kv_cache_groups):
        sizes = tuple(factor if i == g else 0 for i in range(groups))
        src = GPUBlockSpec(tuple(range(1, 1 + factor)), sizes, (0,) * groups)
        dst = GPUBlockSpec(tuple(range(blocks - factor, blocks)), sizes, (0,) * groups)
        before = {name: views[name].clone() for name in group.layer_names}
        assert worker.transfer_async(2 * g, src, CPUBlockSpec((0,)))
        assert worker.transfer_async(2 * g + 1, CPUBlockSpec((0,)), dst)
        assert all(r.success for r in worker.wait([2 * g, 2 * g + 1]))
        for name in group.layer_names:
            got = views[name].reshape(blocks, -1).view(torch.uint8)[blocks - factor :]
            want = before[name].reshape(blocks, -1).view(torch.uint8)[1 : 1 + factor]
            if isinstance(specs[name], MambaSpec):
                got = got[:, : specs[name].page_size_unpadded]
                want = want[:, : specs[name].page_size_unpadded]
            assert torch.equal(got, want), name
