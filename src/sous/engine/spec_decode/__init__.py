"""Speculative decoding building blocks (vLLM v1 semantics), each module self-contained:

- `config`: `SpeculativeConfig`, the `--speculative-config` settings (no torch import, so
  configuration code can use it cheaply);
- `ngram_proposer`: `NgramProposer`, prompt-lookup drafting (numpy);
- `rejection_sampler`: `rejection_sample`, verification of drafts against the target (torch);
- `metrics`: `SpecDecodingStats`, acceptance counters and vLLM's log line.

The scheduler and runner wire them together; import the modules directly.
"""
