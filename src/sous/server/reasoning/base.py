"""What every reasoning parser shares: the split contract and the `<think>` machinery.

A `ReasoningParser` is stateless and shared; `parser.stream(chat_template_kwargs)` makes the
per-request `ReasoningStream`, fed the model's text in pieces (`feed(delta)` returns the new
`(reasoning, content)` text, either possibly empty) and flushed by `finish()`. The
non-streamed `split(text)` is the same stream fed the whole text, so both always agree;
there, empty parts become None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from sous.server.tool_parsers.base import holdback


class ReasoningStream(ABC):
    """Per-request state; owned by one response."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """Consume the next piece of model text; return new (reasoning, content)."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """The output ended: flush held-back text."""


class ReasoningParser(ABC):
    """A reasoning format, registered by `name` in `sous.server.reasoning`."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningStream:
        """A fresh per-request stream (the request's `chat_template_kwargs` may matter)."""

    @abstractmethod
    def reasoning_ended(self, text: str,
                        chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether reasoning is over after `text` (e.g. to start constraining output)."""

    def split(self, text: str, chat_template_kwargs: dict[str, Any] | None = None,
              ) -> tuple[str | None, str | None]:
        """Non-streamed: (reasoning or None, content or None)."""
        stream = self.stream(chat_template_kwargs)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class IdentityStream(ReasoningStream):
    """Everything is content."""

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


class ThinkStream(ReasoningStream):
    """`[<think>] reasoning </think> content`: text is reasoning until the end tag, even
    without the start tag (templates that put `<think>` in the prompt). The first start tag
    met before the end tag is dropped; a suffix that may begin a tag is held back."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buf = ""
        self.in_reasoning = True
        self.start_dropped = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = []
        while self.in_reasoning:
            j = self.buf.find(self.end)
            if not self.start_dropped:
                i = self.buf.find(self.start)
                if i >= 0 and (j < 0 or i < j):
                    reasoning.append(self.buf[:i])
                    self.buf = self.buf[i + len(self.start):]
                    self.start_dropped = True
                    continue
            if j >= 0:
                reasoning.append(self.buf[:j])
                self.buf = self.buf[j + len(self.end):]
                self.in_reasoning = False
                break
            tags = (self.end,) if self.start_dropped else (self.end, self.start)
            cut = len(self.buf) - holdback(self.buf, *tags)
            reasoning.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            return "".join(reasoning), ""
        content, self.buf = self.buf, ""
        return "".join(reasoning), content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.in_reasoning else ("", rest)


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between `<think>` and `</think>`, the start tag optional."""

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def stream(self, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningStream:
        return ThinkStream(self.start_tag, self.end_tag)

    def reasoning_ended(self, text: str,
                        chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        end = text.rfind(self.end_tag)
        return end >= 0 and end > text.rfind(self.start_tag)
