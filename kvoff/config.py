"""Offloading configuration (placeholder, being written)."""
class OffloadingConfig:  # placeholder
    pass
