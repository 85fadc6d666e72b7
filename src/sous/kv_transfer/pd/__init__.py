"""Prefill/decode disaggregation: KV blocks moved between engines (vLLM's NixlConnector)."""
