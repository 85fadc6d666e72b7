"""The router's view of a prompt: token ids from the served model's tokenizer and chat
template, so prefix hashes follow what the model server will cache.

Rendering never fails a request: if the chat template rejects the messages, the ids of the
messages' JSON stand in (the server answers the real error).

Public API: `PromptTokenizer`, `load_prompt_tokenizer`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["PromptTokenizer", "load_prompt_tokenizer"]

logger = logging.getLogger("sous.router")


def _text_content(content: Any) -> Any:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


class PromptTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        rendered = [{**m, "content": _text_content(m.get("content"))}
                    for m in messages if isinstance(m, dict)]
        kwargs: dict[str, Any] = {"add_generation_prompt": body.get("add_generation_prompt", True)}
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, dict):
            kwargs.update({k: v for k, v in extra.items() if k not in ("tokenize", "conversation")})
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, **kwargs)
            return self.encode(text, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - routing must not fail on a bad template input
            logger.debug("chat template failed (%s); hashing the messages' JSON", e)
            return self.encode(json.dumps(messages, sort_keys=True))

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return []

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids for a /v1/chat/completions or /v1/completions body."""
        if path.endswith("/chat/completions"):
            return self.chat_ids(body)
        return self.completion_ids(body)


def load_prompt_tokenizer(model: str | None) -> PromptTokenizer:
    """The tokenizer of a GGUF file or Hugging Face folder (default: the bundled model)."""
    if model is None:
        from sous.models.bundled import bundled_gguf_path

        path = bundled_gguf_path()
    else:
        path = Path(model).expanduser()
    if path.is_file():
        from sous.models.gguf_tokenizer import load_tokenizer

        return PromptTokenizer(load_tokenizer(path))
    if path.is_dir():
        from transformers import AutoTokenizer

        return PromptTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    raise FileNotFoundError(f"--tokenizer {model}: no such GGUF file or model folder")
