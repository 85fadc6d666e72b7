"""Server pieces that need no model: request parsing and checks, the context-length rule,
logprobs formatting and the Prometheus exposition."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sous.config.server import ServerConfig
from sous.engine.outputs import Logprob
from sous.engine.sampling_params import SamplingParams
from sous.server.errors import APIError
from sous.server.metrics import ServerMetrics, buckets_1_2_5
from sous.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from sous.server.serving_common import (
    ServingContext,
    chat_logprobs,
    completion_logprobs,
    resolve_max_tokens,
)


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(10, None, 100) == 90
    assert resolve_max_tokens(10, 90, 100) == 90
    with pytest.raises(APIError, match="100 tokens.*101 tokens \\(10 in the messages, 91"):
        resolve_max_tokens(10, 91, 100)
    with pytest.raises(APIError, match="maximum context length is 100 tokens.*120 input"):
        resolve_max_tokens(120, 1, 100)
    with pytest.raises(APIError, match="100 input tokens"):
        resolve_max_tokens(100, None, 100)


def test_requests_are_logged_only_when_enabled(caplog: pytest.LogCaptureFixture) -> None:
    engine = SimpleNamespace(tokenizer=None)
    for enabled in (False, True):
        ctx = ServingContext(engine, ServerConfig(enable_log_requests=enabled, max_log_len=2),
                             ServerMetrics("m", 8), prompt_bound=SimpleNamespace())
        with caplog.at_level(logging.INFO, logger="sous.server"):
            ctx.log_request(f"req-{enabled}", "hello", [5, 6, 7], SamplingParams())
    assert "req-False" not in caplog.text
    assert "Received request req-True: prompt: 'he', prompt_len: 3" in caplog.text
    assert "prompt_token_ids: [5, 6]" in caplog.text


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"prompt": {"a": 1}}', b'{"prompt": "x", "n": 1.5}'])
def test_parse_errors_are_400(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, raw)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "BadRequestError"


def test_prompt_forms_and_extra_fields() -> None:
    for prompt in ("x", ["x", "y"], [1, 2], [[1], [2, 3]]):
        req = parse_request(CompletionRequest, CompletionRequest(prompt=prompt).model_dump_json())
        assert req.prompt == prompt
    req = parse_request(CompletionRequest, b'{"prompt": "x", "some_future_field": 1}')
    req.check()
    with pytest.raises(APIError, match="empty"):
        parse_request(CompletionRequest, b'{"prompt": []}').check()
    with pytest.raises(APIError, match="suffix"):
        parse_request(CompletionRequest, b'{"prompt": "x", "suffix": "y"}').check()


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("kw", [
    {}, {"tool_choice": "none"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
    {"response_format": {"type": "text"}}, {"max_completion_tokens": 3, "max_tokens": 9},
    {"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
    {"structured_outputs": {"choice": ["a"]}},
    {"stream": True, "stream_options": {"include_usage": True}},
])
def test_chat_checks_accept(kw: dict) -> None:
    req = chat(**kw)
    req.check()
    if "max_completion_tokens" in kw:
        assert req.requested_max_tokens == 3


@pytest.mark.parametrize("kw", [
    {"tools": [{"type": "function"}]}, {"tool_choice": "required"}, {"top_logprobs": 2},
    {"logprobs": True, "top_logprobs": 21}, {"stream_options": {"include_usage": True}},
    {"continue_final_message": True}, {"best_of": 3}, {"logit_bias": {"1": 2.0}},
])
def test_chat_checks_reject(kw: dict) -> None:
    with pytest.raises(APIError) as info:
        chat(**kw).check()
    assert info.value.status == 400


@pytest.mark.parametrize("kw, match", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "only use one kind"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"guided_regex": "a(+"}, "regex"),
])
def test_structured_output_constraints_reject(kw: dict, match: str) -> None:
    from sous.server.structured_request import build_structured_outputs

    req = chat(**kw)
    req.check()
    with pytest.raises(APIError, match=match) as info:
        build_structured_outputs(req)
    assert info.value.status == 400


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_logprobs_formats() -> None:
    entries = [{5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.0, 2, "b"), 7: Logprob(-3.0, 3, None)},
               {9: Logprob(-5.0, 4, "zz"), 6: Logprob(-0.5, 1, "b"), 7: Logprob(-1e6, 2, None)}]
    content = chat_logprobs(_Tok(), [5, 9], entries, 2)
    assert [c["token"] for c in content] == ["a", "zz"]
    assert content[1]["logprob"] == -5.0 and content[1]["bytes"] == [122, 122]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["b", "<7>"]
    assert content[1]["top_logprobs"][1]["logprob"] == -9999.0
    legacy, offset = completion_logprobs(_Tok(), [5, 9], entries, 1, 10)
    assert legacy["tokens"] == ["a", "zz"] and legacy["text_offset"] == [10, 11]
    assert offset == 13
    assert legacy["top_logprobs"] == [{"a": -0.1}, {"zz": -5.0, "b": -0.5}]


def test_metrics_exposition() -> None:
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    m = ServerMetrics('m"x', 100)
    r = m.start(prompt_tokens=7)
    r.tokens(1)
    r.tokens(3)
    r.finish(["stop", "length"])
    r.finish(["stop"])  # ignored: already finished
    text = m.render(None)
    labels = 'engine="0",model_name="m\\"x"'
    assert f"vllm:prompt_tokens_total{{{labels}}} 7.0" in text
    assert f"vllm:generation_tokens_total{{{labels}}} 4.0" in text
    assert f'vllm:request_success_total{{{labels},finished_reason="stop"}} 1.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{{labels},le="5.0"}} 0.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{{labels},le="10.0"}} 1.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{{labels},le="+Inf"}} 1.0' in text
    assert f"vllm:time_per_output_token_seconds_count{{{labels}}} 1.0" in text
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
