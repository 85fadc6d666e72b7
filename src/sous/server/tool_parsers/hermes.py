"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as vLLM's
Hermes2ProToolParser reads it (Hermes, Qwen2.5/Qwen3 templates).

Several blocks may follow each other; the last may be unterminated (output cut off). Each
block's JSON is read as it arrives (`partial_json`): the call's header (id, name) goes out
once the name string is complete, then argument fragments of the canonical
`json.dumps(arguments, ensure_ascii=False)` text. A block whose JSON is not an object with a
string `name` is dropped; missing `arguments` become `{}`; JSON that turns invalid or ends
early is closed where it stopped. Content is the text before the first `<tool_call>`.
"""

from __future__ import annotations

from typing import Any

from sous.server.tool_parsers.base import (
    BlockToolStream,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    ToolStream,
    make_tool_call_id,
)
from sous.server.tool_parsers.partial_json import parse_partial


class HermesToolStream(BlockToolStream):
    START = "<tool_call>"
    END = "</tool_call>"

    def open_block(self) -> None:
        self.index: int | None = None
        self.sent = ""

    def block(self, body: str, closed: bool, out: ToolDelta) -> None:
        node, _ = parse_partial(body)
        if node is None or node.kind != "object":
            return
        if self.index is None:
            name = node.get("name")
            if name is None or name.kind != "string" or not name.complete:
                return
            self.index = self.next_index()
            out.add_call(ToolCallDelta(self.index, make_tool_call_id(), name.text))
        args = node.get("arguments")
        if closed:
            target = args.render() if args is not None else "{}"
        else:
            target = args.prefix() if args is not None else ""
        if len(target) > len(self.sent) and target.startswith(self.sent):
            out.add_call(ToolCallDelta(self.index, arguments=target[len(self.sent):]))
            self.sent = target


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self, tools: list[dict[str, Any]] | None) -> ToolStream:
        return HermesToolStream(tools)
