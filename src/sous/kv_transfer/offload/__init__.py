"""KV offload through LMCache: connector, configuration, storage plugins."""
