"""KV cache movement out of the engine: KV events (ZMQ), later offload tiers and P/D transfer."""
