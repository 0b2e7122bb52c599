"""Engine connectors: kvoff inside inference engines (``kvoff.integrations.vllm`` first)."""
