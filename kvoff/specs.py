"""KV cache specs (placeholder, being written)."""
class FullAttentionSpec:  # placeholder
    pass
