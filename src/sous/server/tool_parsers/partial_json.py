"""JSON that may be cut off anywhere: the stable canonical prefix of what has arrived.

`parse_partial(text)` reads one JSON value from the start of `text` (leading whitespace
allowed) and returns a `Node` tree. Input that ends early, or turns invalid, is treated as
cut off at that point: nothing after it is read. `Node.prefix()` is the longest text that is
certain to start `Node.render()` of any longer input (strings stay open, numbers and
literals are withheld until a delimiter follows, separators wait for the next member);
`Node.render()` closes what is open (drops a half-written key or literal) and is the
canonical form `json.dumps(value, ensure_ascii=False)` with `", "` / `": "` separators,
members in written order. Feeding a growing text therefore gives prefixes that only grow,
and each one starts the final `render()`: streamed argument fragments concatenate to exactly
the non-streamed arguments string.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_SCALAR_CHARS = set("0123456789+-.eE") | set("truefalsn")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


class _Stop(Exception):
    """Input ended or turned invalid: stop reading, keep what was built."""


@dataclass
class Node:
    """One (possibly incomplete) JSON value. `kind`: object | array | string | scalar."""

    kind: str
    complete: bool = False
    text: str = ""
    """string: the decoded characters so far; scalar: the raw token."""
    items: list[tuple[str | None, Node]] = field(default_factory=list)
    """object: (key, value) members; array: (None, value) elements."""

    def get(self, key: str) -> Node | None:
        """The first member named `key` of an object node (None if absent or not an object;
        the first, so that a repeated key cannot change what was already streamed)."""
        if self.kind != "object":
            return None
        return next((v for k, v in self.items if k == key), None)

    def prefix(self) -> str:
        """Stable canonical text: a prefix of `render()` now and after any more input."""
        if self.complete:
            return self.render()
        if self.kind == "string":
            return json.dumps(self.text, ensure_ascii=False)[:-1]
        if self.kind == "scalar":
            return ""
        open_, _ = _BRACKETS[self.kind]
        parts: list[str] = []
        for i, (key, node) in enumerate(self.items):
            last = i == len(self.items) - 1
            head = "" if key is None else json.dumps(key, ensure_ascii=False) + ": "
            body = node.prefix() if last else node.render()
            if last and key is None and not body:
                break
            parts.append(head + body)
        return open_ + ", ".join(parts)

    def render(self) -> str:
        """Canonical text of the value, closing whatever is still open."""
        if self.kind == "string":
            return json.dumps(self.text, ensure_ascii=False)
        if self.kind == "scalar":
            return _render_scalar(self.text)
        open_, close = _BRACKETS[self.kind]
        parts = []
        for key, node in self.items:
            body = node.render()
            head = "" if key is None else json.dumps(key, ensure_ascii=False) + ": "
            parts.append(head + body)
        return open_ + ", ".join(parts) + close


_BRACKETS = {"object": ("{", "}"), "array": ("[", "]")}


def _number(token: str) -> int | float | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _render_scalar(token: str) -> str:
    """Canonical text of a number/literal token; a cut-off one is completed (`tr` -> `true`,
    `1e` -> `1`) and anything else becomes `null`."""
    for lit in _LITERALS:
        if token and lit.startswith(token):
            return lit
    value = _number(token)
    if value is None:
        value = _number(token.rstrip("eE+-."))
    return "null" if value is None else json.dumps(value)


class _Reader:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def skip_ws(self) -> str:
        """The next non-blank character (raises _Stop at the end)."""
        s, i = self.s, self.i
        while i < len(s) and s[i] in _WS:
            i += 1
        self.i = i
        if i >= len(s):
            raise _Stop
        return s[i]

    def value(self, node_box: list[Node]) -> None:
        """Read one value; the node goes into node_box[0] as soon as it exists."""
        c = self.skip_ws()
        if c == "{" or c == "[":
            node = Node("object" if c == "{" else "array")
            node_box.append(node)
            self.i += 1
            self.container(node)
        elif c == '"':
            node = Node("string")
            node_box.append(node)
            self.string(node)
        elif c in _SCALAR_CHARS:
            node = Node("scalar")
            node_box.append(node)
            self.scalar(node)
        else:
            raise _Stop

    def container(self, node: Node) -> None:
        close = "}" if node.kind == "object" else "]"
        c = self.skip_ws()
        if c == close:
            self.i += 1
            node.complete = True
            return
        while True:
            key = None
            if node.kind == "object":
                if self.skip_ws() != '"':
                    raise _Stop
                key_node = Node("string")
                self.string(key_node)
                if self.skip_ws() != ":":
                    raise _Stop
                self.i += 1
                key = key_node.text
            box: list[Node] = []
            try:
                self.value(box)
            finally:
                if box:
                    node.items.append((key, box[0]))
            c = self.skip_ws()
            self.i += 1
            if c == close:
                node.complete = True
                return
            if c != ",":
                raise _Stop

    def string(self, node: Node) -> None:
        s, i = self.s, self.i + 1
        out: list[str] = []
        try:
            while True:
                if i >= len(s):
                    raise _Stop
                c = s[i]
                if c == '"':
                    node.complete = True
                    self.i = i + 1
                    return
                if c != "\\":
                    out.append(c)
                    i += 1
                    continue
                ch, i = _escape(s, i)
                out.append("\ufffd" if 0xD800 <= ord(ch) < 0xE000 else ch)
        finally:
            node.text = "".join(out)

    def scalar(self, node: Node) -> None:
        s, i = self.s, self.i
        while i < len(s) and s[i] in _SCALAR_CHARS:
            i += 1
        node.text = s[self.i:i]
        self.i = i
        if i >= len(s):
            raise _Stop
        if node.text not in _LITERALS and _number(node.text) is None:
            raise _Stop
        node.complete = True


def _escape(s: str, i: int) -> tuple[str, int]:
    """Decode the escape at s[i] == '\\'; returns (chars, next index). _Stop when cut off."""
    if i + 1 >= len(s):
        raise _Stop
    e = s[i + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], i + 2
    if e != "u":
        raise _Stop
    code = _hex4(s, i + 2)
    if 0xD800 <= code < 0xDC00:
        if s[i + 6:i + 8] != "\\u" and len(s) >= i + 8:
            return chr(code), i + 6
        low = _hex4(s, i + 8)
        if 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), i + 12
    return chr(code), i + 6


def _hex4(s: str, i: int) -> int:
    digits = s[i:i + 4]
    if len(digits) < 4:
        raise _Stop
    try:
        return int(digits, 16)
    except ValueError:
        raise _Stop from None


def parse_partial(text: str) -> tuple[Node | None, int]:
    """The value at the start of `text` and the index just after it (or where reading
    stopped). Node is None when not even the first character of a value is there."""
    reader = _Reader(text)
    box: list[Node] = []
    with contextlib.suppress(_Stop):
        reader.value(box)
    return (box[0] if box else None), reader.i
