"""Offline batch generation with vLLM's `LLM` interface."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from sous.engine.core import EngineCore
from sous.engine.outputs import RequestOutput
from sous.engine.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]
"""A prompt: text, token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""


class LLM:
    """`LLM(model=None, **engine_kwargs)`: no model means the bundled SmolLM2-135M-Instruct.
    Keyword arguments are the `sous serve` flags in snake_case (e.g. `max_model_len=2048`),
    plus `enable_sub_block_cache` (default: VLLM_RBLN_SUB_BLOCK_CACHE, else on)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from sous.config.engine_args import engine_config_from_kwargs

        self.engine = EngineCore(engine_config_from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        weakref.finalize(self, self.engine.shutdown)  # worker processes (if any) end with it

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _to_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._to_ids(prompt["prompt"])
        return None, list(prompt)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. Raises
        ValueError (RequestValidationError), adding nothing, if any request is invalid: the
        same checks and messages as the server's (`sous.engine.validation`)."""
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        results: dict[str, RequestOutput] = {}
        requests = []
        for prompt, p in zip(prompts, params, strict=True):  # all valid, or none is added
            text, ids = self._to_ids(prompt)
            final = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.validate(ids, final)
            requests.append((str(next(self._ids)), ids, final, text))
        order = [rid for rid, *_ in requests]
        for rid, ids, final, text in requests:
            self.engine.add_request(rid, ids, final, lambda out: results.__setitem__(
                out.request_id, out), prompt=text)
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                self.engine.step()
                bar.n = len(results)
                bar.refresh()
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
