"""Smoke test of an installed kvoff wheel, run by .ci/wheel-smoke inside a fresh virtual
environment, from a directory outside the source tree.

    python smoke_wheel.py SOURCE_ROOT

Checks, each failing with an AssertionError that says what went wrong:
1. `import kvoff` loads the installed wheel, not the source tree;
2. kvoff.build_info() says the runtime matches, with the wheel's label;
3. a CPU block copy through torch.ops.kvoff.copy_blocks is byte-exact (random ids, 3 layers);
4. a CPUOffloadingManager round trip: store, lookup, load, evict.
`kvoff replay --limit 50` and `kvoff info` are run by the shell script after this.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kvoff

source_root = Path(sys.argv[1]).resolve()
installed = Path(kvoff.__file__).resolve()
assert source_root not in installed.parents, f"kvoff was imported from the source tree: {installed}"
assert "site-packages" in installed.parts, f"kvoff is not an installed package: {installed}"
print(f"smoke: kvoff {kvoff.__version__} from {installed.parent}")

info = kvoff.build_info()
assert info.runtime_matches, info.problems
label = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
assert info.version.endswith("+" + label), (info.version, label)

# 3. CPU block copy: rows src_ids[i] of every layer land in rows dst_ids[i], nothing else changes
g = torch.Generator().manual_seed(0)
layers_src = [
    torch.randint(-128, 127, (64, 2, 16, 8), dtype=torch.int8, generator=g) for _ in range(3)
]
layers_dst = [torch.zeros(40, 2, 16, 8, dtype=torch.int8) for _ in range(3)]
src_ids = torch.randperm(64, generator=g)[:20]
dst_ids = torch.randperm(40, generator=g)[:20]
torch.ops.kvoff.copy_blocks(layers_src, layers_dst, src_ids, dst_ids)
untouched = torch.ones(40, dtype=torch.bool)
untouched[dst_ids] = False
for s, d in zip(layers_src, layers_dst, strict=True):
    assert torch.equal(d[dst_ids], s[src_ids]), "copied rows differ"
    assert not d[untouched].any(), "rows outside dst_block_ids were written"
print("smoke: torch.ops.kvoff.copy_blocks byte-exact on CPU")

# 4. manager round trip
m = kvoff.CPUOffloadingManager(num_blocks=2)
out = m.prepare_store([b"a", b"b"])
assert out is not None and list(out.keys_to_store) == [b"a", b"b"], out
m.complete_store(out.keys_to_store)
assert m.lookup([b"a", b"b", b"c"]) == 2
ids = m.prepare_load([b"a"])
assert sorted(ids) == [ids[0]] and 0 <= ids[0] < 2, ids
m.complete_load([b"a"])
out = m.prepare_store([b"c"])  # pool full: evicts the least recently used key, b"b"
assert out is not None and list(out.evicted_keys) == [b"b"], out
m.complete_store(out.keys_to_store)
assert m.lookup([b"a"]) == 1 and m.lookup([b"b"]) == 0 and m.lookup([b"c"]) == 1
print("smoke: CPUOffloadingManager store / lookup / load / evict round trip")
