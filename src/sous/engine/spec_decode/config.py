"""`--speculative-config`: speculative decoding settings, vLLM's field names and rules.

`SpeculativeConfig.from_dict` turns the flag's JSON object into a resolved, validated config:

- `method` is inferred when missing: `model` "ngram" (or "[ngram]") means `ngram`; a dotted
  Python path means vLLM's `custom_class`; a draft checkpoint whose name holds "eagle-" or
  "eagle3" means `eagle` / `eagle3`; anything else is vLLM's `draft_model`.
- vLLM's model-specific MTP method names (`deepseek_mtp`, `qwen3_next_mtp`, ...) mean `mtp`.
- n-gram window: neither bound given -> both 5; one given -> the other copies it; each >= 1
  and min <= max.
- suffix decoding: `num_speculative_tokens` defaults to `suffix_decoding_max_tree_depth` (at
  most `MAX_SPEC_LEN`) and is a maximum; depth >= 1, cached requests >= 0, spec factor >= 0,
  min token prob in [0, 1].
- `eagle` / `eagle3` need `model` (the draft head checkpoint). `mtp` without `model` uses the
  target checkpoint's own MTP layers (and the target's quantization).
- `num_speculative_tokens` (k) is in [1, MAX_SPEC_LEN]. It is required for `ngram` and for
  `mtp` without `model`; for `eagle` / `eagle3` / `mtp` with a `model` it may be left out and
  then comes from the draft checkpoint's `n_predict` (`with_draft_n_predict`).

sous implements `ngram`, `suffix`, `eagle3`, `eagle` and `mtp`; vLLM's other methods are
refused by name. Other vLLM fields are accepted only at their vLLM default value (so configs
written for vLLM keep working) and refused by name otherwise. Every error is a `ConfigError`
(a ValueError) whose one-line message starts with the flag and names the field or method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sous.config.errors import ConfigError

FLAG = "--speculative-config"
MAX_SPEC_LEN = 32
"""Most draft tokens per request and step (vLLM's rejection sampler bound)."""

SUPPORTED_METHODS = ("ngram", "suffix", "eagle3", "eagle", "mtp")
NOT_YET_METHODS = ("medusa", "mlp_speculator", "draft_model", "custom_class", "ngram_gpu",
                   "extract_hidden_states", "dflash", "dspark")
MTP_ALIASES = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp")
"""vLLM's model-specific MTP method names, all meaning `mtp`."""

_NGRAM_DEFAULT = 5
# vLLM fields sous does not implement, with their vLLM default: accepted (and ignored) at
# that value, refused otherwise.
_VLLM_DEFAULTS: dict[str, Any] = {
    "enforce_eager": None, "moe_backend": None, "attention_backend": None,
    "kv_cache_dtype": None, "index_share_for_mtp_iteration": None,
    "disable_eagle_block_drop": False, "use_local_argmax_reduction": False,
    "use_heterogeneous_vocab": False, "parallel_drafting": False,
    "num_speculative_tokens_per_batch_size": None, "draft_load_config": None,
    "rejection_sample_method": "standard", "synthetic_acceptance_rates": None,
    "synthetic_acceptance_length": None, "enable_adaptive_verification": False,
    "draft_sample_method": "greedy", "dspark_draft_topk": None,
    "speculative_token_tree": None,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding settings (build with `from_dict`; see the module
    docstring for the rules)."""

    method: str = "ngram"
    """`ngram`, `suffix`, `eagle3`, `eagle` or `mtp` (inferred from `model` when missing)."""
    model: str | None = None
    """Draft checkpoint: the EAGLE head for `eagle` / `eagle3`; for `mtp`, None means the
    target checkpoint. None for `ngram` and `suffix`."""
    num_speculative_tokens: int | None = None
    """k, the most draft tokens per request and step, in [1, 32]. None only for a
    model-based method whose checkpoint supplies it (`with_draft_n_predict`)."""
    draft_tensor_parallel_size: int | None = None
    """Tensor parallel size of the draft model (sous runs one device: 1)."""
    quantization: str | None = None
    """Quantization of the draft weights (None: unquantized; for `mtp` without `model`, the
    target's)."""
    max_model_len: int | None = None
    """Max model length of the draft (None: the target's; never more than the target's)."""
    revision: str | None = None
    """Draft checkpoint revision (branch, tag or commit)."""
    code_revision: str | None = None
    """Draft checkpoint code revision on the Hugging Face Hub."""
    disable_padded_drafter_batch: bool = False
    """Let EAGLE draft batches hold sequences of different lengths instead of padding."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched by `ngram` (default: `prompt_lookup_max`, else 5)."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched by `ngram` (default: `prompt_lookup_min`, else 5)."""
    suffix_decoding_max_tree_depth: int = 24
    """Depth of the suffix trees: bounds prefix match plus speculation length."""
    suffix_decoding_max_cached_requests: int = 10000
    """Responses kept in the global suffix tree, evicted FIFO (0: no global tree)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """Speculate at most `factor * prefix match length` tokens."""
    suffix_decoding_min_token_prob: float = 0.1
    """Stop speculating below this estimated token probability."""
    disable_by_batch_size: int | None = None
    """Schedule no drafts while more than this many requests are running or waiting (at
    least 2; None: always draft)."""
    draft_confidence_threshold: float = 0.0
    """`eagle` / `eagle3` / `mtp`, in [0, 1]: a request's drafts end at the first draft token
    whose probability under the drafter is below this (the first one included: then the
    request drafts nothing this step). 0: always draft k. The name is that of vLLM's proposal
    for dynamic speculation length, which averages the probability over the batch; sous
    decides per request."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from the flag's JSON object, applying vLLM's inference, defaults and
        validation. ConfigError naming the field or method otherwise."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{FLAG} must be a JSON object, got {data!r}")
        data = dict(data)
        _check_fields(data)
        method = _resolve_method(data.get("method"), data.get("model"))
        d = {**data, "method": method}
        if method in ("ngram", "suffix"):
            d["model"] = None
        elif method in ("eagle", "eagle3") and not d.get("model"):
            raise ConfigError(f"{FLAG}: method {method!r} needs 'model' (the draft head "
                              "checkpoint)")
        k = d.get("num_speculative_tokens")
        if method == "ngram":
            d.update(_ngram_window(d.get("prompt_lookup_min"), d.get("prompt_lookup_max")))
        else:  # vLLM ignores the window for other methods
            d["prompt_lookup_min"] = d["prompt_lookup_max"] = None
        if method == "suffix":
            _check_suffix(d)
            if k is None:
                k = min(d.get("suffix_decoding_max_tree_depth", 24), MAX_SPEC_LEN)
        if k is None and (method == "ngram" or (method == "mtp" and not d.get("model"))):
            raise ConfigError(f"{FLAG}: num_speculative_tokens is required for method "
                              f"{method!r}")
        d["num_speculative_tokens"] = k
        if k is not None:
            _check_k(k)
        _check_confidence(method, d.get("draft_confidence_threshold", 0.0))
        if (limit := d.get("disable_by_batch_size")) is not None and limit < 2:
            raise ConfigError(f"{FLAG}: disable_by_batch_size must be > 1, got {limit}")
        tp = d.get("draft_tensor_parallel_size")
        if tp is not None and tp < 1:
            raise ConfigError(f"{FLAG}: draft_tensor_parallel_size must be >= 1, got {tp}")
        if tp is not None and tp > 1:
            raise ConfigError(f"{FLAG}: draft_tensor_parallel_size={tp} is not supported yet: "
                              "sous runs one device (use 1)")
        if (n := d.get("max_model_len")) is not None and n < 1:
            raise ConfigError(f"{FLAG}: max_model_len must be >= 1, got {n}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: v for name, v in d.items() if name in fields})

    def with_draft_n_predict(self, n_predict: int | None) -> SpeculativeConfig:
        """Apply the draft checkpoint's `n_predict` (MTP layers / EAGLE steps it was trained
        for), as vLLM does: a missing k defaults to it; a k above it must be a multiple of it
        (layers are reused in turn). ConfigError when k is still unknown."""
        k = self.num_speculative_tokens
        if n_predict is not None:
            if k is None:
                k = n_predict
                _check_k(k)
            elif k > n_predict and k % n_predict != 0:
                raise ConfigError(f"{FLAG}: num_speculative_tokens={k} must be a multiple of "
                                  f"the draft checkpoint's n_predict={n_predict}")
        if k is None:
            raise ConfigError(f"{FLAG}: num_speculative_tokens is required: the draft "
                              f"checkpoint {self.model!r} has no n_predict")
        return dataclasses.replace(self, num_speculative_tokens=k)

    def use_eagle(self) -> bool:
        """Drafting from the target's hidden states (EAGLE, EAGLE-3, MTP): the drafter keeps
        its own KV cache, written ahead of the target."""
        return self.method in ("eagle", "eagle3", "mtp")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler allocates beyond the scheduled tokens (vLLM: k for
        EAGLE-style drafters, whose draft steps write KV; 0 otherwise)."""
        return (self.num_speculative_tokens or 0) if self.use_eagle() else 0


def resolve_speculative_config(value: Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """`EngineConfig.speculative_config` (the flag's JSON) resolved; None when off."""
    return None if value is None else SpeculativeConfig.from_dict(value)


def _check_fields(data: dict[str, Any]) -> None:
    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    for name in [n for n, v in data.items() if v is None]:
        del data[name]  # JSON null: unset
    for name in sorted(data):
        value = data[name]
        if name == "tensor_parallel_size":
            raise ConfigError(f"{FLAG}: 'tensor_parallel_size' is not a valid field; use "
                                  "'draft_tensor_parallel_size'")
        elif name in _VLLM_DEFAULTS:
            if value != _VLLM_DEFAULTS[name] and not (name == "attention_backend"
                                                      and value == "auto"):
                raise ConfigError(f"{FLAG}: {name}={value!r} is not supported yet (sous "
                                  f"accepts only vLLM's default, {_VLLM_DEFAULTS[name]!r})")
        elif name not in fields:
            raise ConfigError(f"{FLAG}: unknown field {name!r}; known fields: "
                              f"{', '.join(fields)}")
        else:
            _check_type(name, str(fields[name].type), value)
    for name in list(data):
        if name not in fields:
            del data[name]


def _check_type(name: str, type_: str, value: Any) -> None:
    if "bool" in type_:
        ok, want = isinstance(value, bool), "true or false"
    elif "int" in type_:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif "float" in type_:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        want = "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{FLAG}: {name} must be {want}, got {value!r}")


def _is_python_path(model: str | None) -> bool:
    if not model or model.startswith(("http://", "https://", "file://")) or "/" in model:
        return False
    parts = model.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def _resolve_method(method: str | None, model: str | None) -> str:
    if method is None:
        if model is None:
            raise ConfigError(f"{FLAG}: set 'method' (one of {', '.join(SUPPORTED_METHODS)})")
        if _is_python_path(model):
            method = "custom_class"
        elif model in ("ngram", "[ngram]"):
            method = "ngram"
        elif "eagle-" in model.lower():
            method = "eagle"
        elif "eagle3" in model.lower():
            method = "eagle3"
        else:
            raise ConfigError(f"{FLAG}: method 'draft_model' (a separate draft model, "
                              f"inferred from model {model!r}) is not supported yet; set "
                              f"'method' to one of {', '.join(SUPPORTED_METHODS)}")
    if method == "[ngram]":
        method = "ngram"
    if method in MTP_ALIASES:
        method = "mtp"
    if method in NOT_YET_METHODS:
        raise ConfigError(f"{FLAG}: method {method!r} is not supported yet; supported: "
                          f"{', '.join(SUPPORTED_METHODS)}")
    if method not in SUPPORTED_METHODS:
        raise ConfigError(f"{FLAG}: unknown method {method!r}; known methods: "
                          f"{', '.join(SUPPORTED_METHODS + NOT_YET_METHODS)} (and vLLM's "
                          "model-specific MTP names, meaning 'mtp')")
    return method


def _ngram_window(lo: int | None, hi: int | None) -> dict[str, int]:
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and v < 1:
            raise ConfigError(f"{FLAG}: {name} must be >= 1, got {v}")
    if lo is None and hi is None:
        lo = hi = _NGRAM_DEFAULT
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    assert lo is not None and hi is not None
    if lo > hi:
        raise ConfigError(f"{FLAG}: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}


def _check_suffix(d: dict[str, Any]) -> None:
    checks = (("suffix_decoding_max_tree_depth", 24, lambda v: v >= 1, ">= 1"),
              ("suffix_decoding_max_cached_requests", 10000, lambda v: v >= 0, ">= 0"),
              ("suffix_decoding_max_spec_factor", 1.0, lambda v: v >= 0, ">= 0"),
              ("suffix_decoding_min_token_prob", 0.1, lambda v: 0 <= v <= 1, "in [0, 1]"))
    for name, default, ok, want in checks:
        v = d.get(name, default)
        if not ok(v):
            raise ConfigError(f"{FLAG}: {name}={v} must be {want}")


def _check_confidence(method: str, threshold: float) -> None:
    if not 0 <= threshold <= 1:
        raise ConfigError(f"{FLAG}: draft_confidence_threshold={threshold} must be in [0, 1]")
    if threshold and method in ("ngram", "suffix"):
        raise ConfigError(f"{FLAG}: draft_confidence_threshold applies to drafter models "
                          f"(eagle, eagle3, mtp), not method {method!r}"
                          + (" (suffix has suffix_decoding_min_token_prob)"
                             if method == "suffix" else ""))


def _check_k(k: int) -> None:
    if not 1 <= k <= MAX_SPEC_LEN:
        raise ConfigError(f"{FLAG}: num_speculative_tokens must be in [1, {MAX_SPEC_LEN}], "
                          f"got {k}")
