"""Worker (placeholder, being written)."""
class CPUBlockSpec:  # placeholder
    pass
class GPUBlockSpec:  # placeholder
    pass
class OffloadingWorker:  # placeholder
    pass
class TransferResult:  # placeholder
    pass
