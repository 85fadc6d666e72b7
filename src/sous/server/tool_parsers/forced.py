"""Reading the output of `tool_choice` "required" and named (`{"type": "function",
"function": {"name": ...}}`), which structured output constrains (vLLM's shapes).

- named: the whole output (after reasoning) is the arguments of that one function; the
  header goes out with the first piece, then the text as it comes.
- "required": the output is a JSON array `[{"name": ..., "parameters": {...}}, ...]`; each
  element becomes a call as its name completes, and its `parameters` stream as canonical
  JSON fragments (`partial_json`). Output that does not start with `[` is content.
"""

from __future__ import annotations

from sous.server.tool_parsers.base import (
    ToolCallDelta,
    ToolDelta,
    ToolStream,
    make_tool_call_id,
)
from sous.server.tool_parsers.partial_json import Node, parse_partial


class NamedToolStream(ToolStream):
    """`tool_choice` names one function: all output text is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if not self.started:
            self.started = True
            out.add_call(ToolCallDelta(0, make_tool_call_id(), self.name, text))
        elif text:
            out.add_call(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ToolDelta:
        return self.feed("") if not self.started else ToolDelta()


class RequiredToolStream(ToolStream):
    """`tool_choice: "required"`: a JSON array of `{"name", "parameters"}` objects."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None (undecided) | "array" | "content"
        self.calls: list[tuple[int, str] | None] = []
        """Per array element: (call index, arguments sent) or None when it has no call."""
        self.num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        return self._run(text, closed=False)

    def finish(self) -> ToolDelta:
        return self._run("", closed=True)

    def _run(self, text: str, closed: bool) -> ToolDelta:
        out = ToolDelta()
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if not head and not closed:
                return out
            self.mode = "array" if head.startswith("[") else "content"
        if self.mode == "content":
            out.content, self.buf = self.buf, ""
            return out
        node, _ = parse_partial(self.buf)
        if node is None or node.kind != "array":
            return out
        items = [v for _, v in node.items]
        for i, item in enumerate(items):
            done = closed or item.complete or i < len(items) - 1
            self._element(i, item, done, out)
        return out

    def _element(self, i: int, item: Node, done: bool, out: ToolDelta) -> None:
        while len(self.calls) <= i:
            self.calls.append(None)
        state = self.calls[i]
        if state is None:
            name = item.get("name")
            if name is None or name.kind != "string" or not name.complete:
                return
            state = (self.num_calls, "")
            self.num_calls += 1
            out.add_call(ToolCallDelta(state[0], make_tool_call_id(), name.text))
        params = item.get("parameters")
        if done:
            target = params.render() if params is not None else "{}"
        else:
            target = params.prefix() if params is not None else ""
        index, sent = state
        if len(target) > len(sent) and target.startswith(sent):
            out.add_call(ToolCallDelta(index, arguments=target[len(sent):]))
            sent = target
        self.calls[i] = (index, sent)
