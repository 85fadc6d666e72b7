"""Text cut the way a streaming detokenizer delivers it, for parser tests."""

from __future__ import annotations

from typing import Any


def token_pieces(tok: Any, text: str, group: int) -> list[str]:
    """`text` cut where its tokens end, `group` tokens per piece (decoded incrementally)."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for end in list(range(group, len(ids), group)) + [len(ids)]:
        now = tok.decode(ids[:end])
        pieces.append(now[len(prev):])
        prev = now
    assert "".join(pieces) == text
    return pieces
