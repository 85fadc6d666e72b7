"""Attention kernels behind `sous.engine.attention`.

* `build`: builds/loads the `sous_ops` C++ extension (`csrc/`, CPU, OpenMP on torch's pool);
* `cpu_attention`: the Python side of its kernels (paged GQA, MLA latent and flat prefill
  attention, the V3.2 indexer's scores);
* `torch_attention`: the pure-torch path (any device; CPU when the extension cannot be built).
"""
