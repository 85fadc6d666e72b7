"""What every tool-call parser shares: the call / delta records and the streaming contract.

A `ToolParser` is stateless and shared by all requests; `parser.stream(tools)` makes the
per-request `ToolStream`, which is fed the model's text in pieces (`feed(delta)`) and
returns what is new: content text and tool-call fragments (`ToolDelta`). `finish()` flushes
what was held back (a half-seen tag, an unterminated call). The non-streamed result
(`extract`) is the same stream fed the whole text at once, so streamed and non-streamed
results agree exactly: concatenated argument fragments == the non-streamed arguments string.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def make_tool_call_id() -> str:
    """vLLM's default tool-call id: `chatcmpl-tool-<32 hex>`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One complete call; `arguments` is a JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """`message.tool_calls[i]` of a chat completion."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A fragment of call number `index`: the first one carries `id` and `name`, every one
    may carry a piece of the arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """`delta.tool_calls[i]` of a chat completion chunk."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = ({"arguments": self.arguments} if self.name is None
                           else {"name": self.name, "arguments": self.arguments})
        return out


@dataclass
class ToolDelta:
    """What one `feed`/`finish` produced: content text and call fragments, in order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call(self, delta: ToolCallDelta) -> None:
        """Append, merging into the previous fragment when it is for the same call."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments
        else:
            self.tool_calls.append(delta)

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        for d in other.tool_calls:
            self.add_call(d)


def assemble(deltas: list[ToolDelta]) -> tuple[str | None, list[ToolCall]]:
    """Join a stream's deltas into (content or None when empty, calls in index order)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for f in d.tool_calls:
            call = calls.get(f.index)
            if call is None:
                calls[f.index] = ToolCall(f.id or make_tool_call_id(), f.name or "", f.arguments)
            else:
                call.arguments += f.arguments
    return content or None, [calls[i] for i in sorted(calls)]


def holdback(text: str, *tags: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`
    (text that must wait: it may be the start of a tag split across tokens)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ToolStream(ABC):
    """Per-request parsing state; not thread-safe, owned by one response."""

    @abstractmethod
    def feed(self, text: str) -> ToolDelta:
        """Consume the next piece of model text; return what can be emitted now."""

    @abstractmethod
    def finish(self) -> ToolDelta:
        """The output ended: flush held-back text, close an unterminated call."""


class ToolParser(ABC):
    """A tool-call format, registered by `name` in `sous.server.tool_parsers`."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    """The format's tags are special tokens: detokenize with skip_special_tokens=False."""

    @abstractmethod
    def stream(self, tools: list[dict[str, Any]] | None) -> ToolStream:
        """A fresh per-request stream; `tools` is the request's `tools` list."""

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None,
                ) -> tuple[str | None, list[ToolCall]]:
        """Non-streamed: (content before the first call, or None; the calls)."""
        stream = self.stream(tools)
        return assemble([stream.feed(text), stream.finish()])


def find_tool(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any] | None:
    """The `function` object of the request tool called `name` (None if absent)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            return function
    return None


class BlockToolStream(ToolStream):
    """Formats where calls sit in `START ... END` blocks after optional content.

    Text before the first START is content (a suffix that may begin START is held back);
    once a block has opened, text outside blocks is dropped. If the output ends without any
    call (no block held a valid one), everything from the first START on is content after
    all, emitted by `finish()` (vLLM's fallback for unparsable calls). Subclasses get each block's
    body so far through `block(body, closed, out)`, called after every feed with the whole
    body since START (minus a held-back partial END); `closed` is true once END (or the end
    of output) is reached, and then exactly once.
    """

    START: ClassVar[str]
    END: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools
        self.buf = ""
        self.in_block = False
        self.started = False
        self.num_calls = 0
        self.since_start: list[str] = []
        """All text from the first START on (the fallback content)."""

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if self.started:
            self.since_start.append(text)
        self.buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._run(out, final=True)
        if self.started and not self.num_calls:
            out.content += "".join(self.since_start)
        return out

    def _run(self, out: ToolDelta, final: bool) -> None:
        while True:
            if not self.in_block:
                i = self.buf.find(self.START)
                end = i if i >= 0 else len(self.buf) - (0 if final else holdback(
                    self.buf, self.START))
                if not self.started:
                    out.content += self.buf[:end]
                if i < 0:
                    self.buf = self.buf[end:]
                    return
                if not self.started:
                    self.since_start = [self.buf[i:]]
                self.buf = self.buf[i + len(self.START):]
                self.in_block = self.started = True
                self.open_block()
                continue
            j = self.buf.find(self.END)
            if j < 0:
                cut = len(self.buf) if final else len(self.buf) - holdback(self.buf, self.END)
                self.block(self.buf[:cut], final, out)
                if final:
                    self.buf, self.in_block = "", False
                return
            self.block(self.buf[:j], True, out)
            self.buf = self.buf[j + len(self.END):]
            self.in_block = False

    def next_index(self) -> int:
        """Index for a new call (calls are numbered in the order their headers go out)."""
        self.num_calls += 1
        return self.num_calls - 1

    def open_block(self) -> None:
        """A new block starts (reset per-block state)."""

    @abstractmethod
    def block(self, body: str, closed: bool, out: ToolDelta) -> None:
        """Emit into `out` what the block body (so far) adds."""
