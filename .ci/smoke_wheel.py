"""Smoke test of an installed kvoff wheel, run by .ci/wheel-smoke inside a fresh virtual
environment, from a directory outside the source tree.

    python smoke_wheel.py SOURCE_ROOT WHEEL [--record FILE]

Checks, each failing with an AssertionError that says what went wrong:
1. `import kvoff` loads the installed wheel, not the source tree;
2. kvoff.build_info() says the runtime matches, with the wheel's label;
3. a CPU block copy through torch.ops.kvoff.copy_blocks is byte-exact (random ids, 3 layers);
4. a CPUOffloadingManager round trip: store, lookup, load, evict;
5. `kvoff replay --limit 50` (the installed console script) loads and verifies blocks;
6. `kvoff info` exits 0.
--record writes a JSON record: wheel name, size and sha256, machine, GPUs, build_info, replay.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import kvoff
from kvoff._build_metadata import local_label
from kvoff.tools.bench import machine_info

parser = argparse.ArgumentParser()
parser.add_argument("source_root", type=Path)
parser.add_argument("wheel", type=Path)
parser.add_argument("--record", type=Path, default=None)
args = parser.parse_args()

source_root = args.source_root.resolve()
installed = Path(kvoff.__file__).resolve()
assert source_root not in installed.parents, f"kvoff was imported from the source tree: {installed}"
assert "site-packages" in installed.parts, f"kvoff is not an installed package: {installed}"
print(f"smoke: kvoff {kvoff.__version__} from {installed.parent}")

# 2. the install matches this process
info = kvoff.build_info()
assert info.runtime_matches, info.problems
label = local_label(torch.version.cuda)
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
assert len(ids) == 1 and 0 <= ids[0] < 2, ids
m.complete_load([b"a"])
out = m.prepare_store([b"c"])  # pool full: evicts the least recently used key, b"b"
assert out is not None and list(out.evicted_keys) == [b"b"], out
m.complete_store(out.keys_to_store)
assert m.lookup([b"a"]) == 1 and m.lookup([b"b"]) == 0 and m.lookup([b"c"]) == 1
print("smoke: CPUOffloadingManager store / lookup / load / evict round trip")

# 5. + 6. the installed console script
kvoff_exe = Path(sys.executable).parent / "kvoff"
with tempfile.TemporaryDirectory() as tmp:
    replay_json = Path(tmp) / "replay.json"
    subprocess.run(
        [kvoff_exe, "replay", "--limit", "50", "--no-progress", "--json", replay_json], check=True
    )
    replay = json.loads(replay_json.read_text())["result"]
assert replay["requests"] == 50, replay
assert replay["corrupted_blocks"] == 0 and replay["failed_transfers"] == 0, replay
assert replay["blocks_loaded"] > 0 and replay["blocks_verified"] > 0, replay
print(
    f"smoke: kvoff replay --limit 50: {replay['requests']} requests, {replay['blocks_loaded']} "
    "blocks loaded and verified"
)
subprocess.run([kvoff_exe, "info"], check=True)

REPLAY_KEYS = ("requests", "hit_rate", "blocks_loaded", "blocks_verified", "corrupted_blocks")
if args.record is not None:
    wheel = args.wheel
    record = {
        "command": "bash .ci/wheel-smoke " + wheel.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info()
        | {
            "python": platform.python_version(),
            "gpus": [f"{g.name} (sm_{g.capability[0]}{g.capability[1]})" for g in info.gpus],
        },
        "wheel": {
            "name": wheel.name,
            "size_bytes": wheel.stat().st_size,
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        },
        "build_info": info.as_dict(),
        "replay_limit_50": {k: replay[k] for k in REPLAY_KEYS},
        "smoke": "passed",
    }
    args.record.write_text(json.dumps(record, indent=2) + "\n")
    print(f"smoke: record written to {args.record}")
