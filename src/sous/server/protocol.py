"""Request models of the OpenAI API with vLLM's extra fields (pydantic, parsed once per request).

Responses are built as plain dicts in the serving modules (cheap on the streaming hot path);
their shapes are documented there. Unknown request fields are accepted and ignored, as vLLM
does (it only logs them).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sous.server.errors import APIError, bad_request, format_validation_error

_MAX_LOGPROBS = 20
_M = TypeVar("_M", bound=BaseModel)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(_Base):
    include_usage: bool | None = True
    """Send a last chunk with `usage` and empty `choices`."""
    continuous_usage_stats: bool | None = False
    """vLLM extra: put the running `usage` on every chunk."""


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    """`response_format`, `structured_outputs` and `guided_*` become
    `SamplingParams.structured_outputs` in `sous.server.structured_request`."""
    kv_transfer_params: dict[str, Any] | None = None

    def check_common(self) -> None:
        """400s shared by both APIs for fields sous does not implement yet or rejects."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.",
                              "stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of different from n is not supported yet.", 400, "best_of")
        if self.logit_bias:
            raise APIError("logit_bias is not supported yet.", 400, "logit_bias")
        if self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not supported yet.", 400, "prompt_logprobs")
        if self.kv_transfer_params and self.n != 1:
            raise bad_request("kv_transfer_params needs n = 1.", "kv_transfer_params")

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams` (besides max_tokens, logprobs, output_kind)."""
        kw: dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.kv_transfer_params:
            kw["extra_args"] = {"kv_transfer_params": dict(self.kv_transfer_params)}
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_common()
        if self.suffix is not None:
            raise APIError("suffix is not currently supported.", 400, "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {_MAX_LOGPROBS}, "
                              f"got {self.logprobs}.", "logprobs")
        if self.echo and self.logprobs is not None:
            raise APIError("echo together with logprobs is not supported yet.", 400, "echo")
        if isinstance(self.prompt, list) and (
                len(self.prompt) == 0 or any(isinstance(p, list) and not p for p in self.prompt)):
            raise bad_request("Prompt cannot be empty.", "prompt")


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.",
                              "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= _MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {_MAX_LOGPROBS}, "
                              f"got {self.top_logprobs}.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")
        if self.echo:
            raise APIError("echo is not supported yet for chat completions.", 400, "echo")
        if self.chat_template is not None:
            raise APIError("Chat template is passed with request, but "
                           "--trust-request-chat-template is not set.", 400, "chat_template")
        self.check_tools()

    def check_tools(self) -> None:
        """vLLM's `tools` / `tool_choice` validation (400s); see `effective_tool_choice`."""
        for tool in self.tools or []:
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise bad_request("Each tool must be {\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": {...}}}.", "tools")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise bad_request(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                              "\"none\", \"auto\" or \"required\" are supported.", "tool_choice")
        if isinstance(choice, dict):
            usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
            function = choice.get("function")
            if not isinstance(function, dict):
                raise bad_request(f"Invalid value for `function`: `{function}` in "
                                  f"`tool_choice`! {usage}", "tool_choice")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"Expected field `name` in `function` in `tool_choice`! "
                                  f"{usage}", "tool_choice")
            if all(t["function"]["name"] != name for t in self.tools):
                raise bad_request("The tool specified in `tool_choice` does not match any of "
                                  "the specified `tools`", "tool_choice")

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """`tool_choice`, defaulting (as vLLM) to "auto" with tools, "none" without;
        "required" with an empty `tools` list behaves as "none"."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice == "required" and not self.tools:
            return "none"
        return choice

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def parse_request(model: type[_M], raw: bytes) -> _M:
    """Validate a JSON body; any problem (bad JSON, wrong types, missing fields) -> 400."""
    if not raw.strip():
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        param = None
        if errors and errors[0].get("loc"):
            param = str(errors[0]["loc"][0])
        raise bad_request(format_validation_error(errors), param) from None
