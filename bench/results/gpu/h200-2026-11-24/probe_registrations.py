"""Do kvoff's copy mechanisms copy a host row that spans two cudaHostRegister ranges?

Eight 6 KiB rows registered as two ranges cut inside row 1; row 1 copied from the GPU with each
mechanism. Run on the CUDA build: python3 probe_registrations.py (output: probe_registrations.txt).
"""

import torch

import kvoff  # noqa: F401
from kvoff.ops import copy_blocks

cudart = torch.cuda.cudart()
row = 6144
raw = torch.empty(8 * row + 4096, dtype=torch.uint8)
lead = -raw.data_ptr() % 4096
buf = raw[lead : lead + 8 * row]
base = buf.data_ptr()
cut = 8192  # inside row 1 (6144..12288)
raw_ptr = raw.data_ptr()
print(
    "register",
    int(cudart.cudaHostRegister(raw_ptr, lead + cut, 3)),
    int(cudart.cudaHostRegister(base + cut, 8 * row - cut, 3)),
)
cpu = buf.view(8, row)
gpu = torch.randint(0, 256, (8, row), dtype=torch.uint8, device="cuda")
for m in ("memcpy", "batch", "kernel", "per_block"):
    cpu.zero_()
    s = torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            copy_blocks([gpu], [cpu], [1], [1], mechanism=m)
        s.synchronize()
        print(
            m,
            "row straddling two registrations:",
            "ok" if torch.equal(cpu[1], gpu[1].cpu()) else "WRONG BYTES",
        )
    except RuntimeError as e:
        print(m, "row straddling two registrations: error:", str(e)[:200])
print(
    "unregister",
    int(cudart.cudaHostUnregister(raw_ptr)),
    int(cudart.cudaHostUnregister(base + cut)),
)
