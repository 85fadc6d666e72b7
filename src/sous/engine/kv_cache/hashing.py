"""Prefix-cache block hashes: parent-chained hashes of full blocks, as vLLM computes them.

`sha256`: SHA-256 of the pickled `(parent, tokens, extra_keys)` tuple (Python-only).
`sha256_cbor`: SHA-256 of its canonical CBOR encoding (reproducible in any language).
The chain root is NONE_HASH: the hash of the `PYTHONHASHSEED` string when set, else random.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

logger = logging.getLogger(__name__)

HashFn = Callable[[Any], bytes]


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"Unknown prefix caching hash algorithm {name!r}; choose one of "
            f"{sorted(HASH_FUNCTIONS)}."
        ) from None


def none_hash(hash_fn: HashFn) -> bytes:
    """Root of every chain: the hash of PYTHONHASHSEED, else random per process. Processes
    that must agree need the same PYTHONHASHSEED; whoever publishes hashes to another
    process warns when it is unset (`warn_if_hashes_unshared`)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hash_fn(seed)


def warn_if_hashes_unshared(feature: str) -> None:
    """One warning line when `feature` sends block hashes to other processes but
    PYTHONHASHSEED is unset (so they cannot match them)."""
    if os.environ.get("PYTHONHASHSEED") is None:
        logger.warning("PYTHONHASHSEED is not set: %s carry block hashes that no other "
                       "process can match; set the same PYTHONHASHSEED everywhere.", feature)


def hash_block_tokens(
    hash_fn: HashFn, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    return hash_fn((parent, tuple(token_ids), extra_keys))


def hash_request_blocks(
    hash_fn: HashFn,
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    known: list[bytes],
) -> None:
    """Extend `known` (mutated) with the hashes of every further full block of `token_ids`."""
    num_full = len(token_ids) // block_size
    parent = known[-1] if known else root
    for i in range(len(known), num_full):
        parent = hash_block_tokens(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size])
        known.append(parent)
