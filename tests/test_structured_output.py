"""Structured output in the engine: parameter validation, xgrammar bitmasks on the real
SmolLM2 tokenizer, the scheduler's WAITING_FOR_FSM gate, and constrained generation on the
bundled model (greedy, so outputs are exact), including the reasoning-end hook."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

from sous import LLM, SamplingParams
from sous.config.scheduler import SchedulerConfig
from sous.config.structured_outputs import StructuredOutputsConfig
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.outputs import RequestOutput
from sous.engine.request import Request, RequestStatus
from sous.engine.sampling_params import RequestOutputKind
from sous.engine.scheduler import Scheduler
from sous.engine.structured_output import StructuredOutputsParams
from sous.engine.structured_output.backend_xgrammar import XgrammarBackend, validate
from sous.engine.structured_output.manager import StructuredOutputManager
from sous.engine.structured_output.request import StructuredOutputRequest

VOCAB = 49152
EOS = 2
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


# ---- parameters --------------------------------------------------------------------------

def test_xgrammar_loads_only_with_a_structured_request() -> None:
    """The engine and the server import xgrammar on their first structured request: a server
    that never gets one does not pay its memory or start-up time."""
    code = ("import sys, sous.engine.core, sous.server.api_server; "
            "sys.exit(3 if 'xgrammar' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="must use one kind .* none are specified"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="only use one kind .* multiple are specified"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="not supported yet"):
        StructuredOutputsParams(structural_tag="{}")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == \
        StructuredOutputsParams(regex="a+")


def test_params_specs_and_keys() -> None:
    as_dict = StructuredOutputsParams(json=PERSON)
    as_text = StructuredOutputsParams(json=json.dumps(PERSON, indent=2))
    assert as_dict.key() == as_text.key()
    assert list(json.loads(as_dict.spec())["properties"]) == ["name", "age"]
    assert StructuredOutputsParams(choice=['a"b', "c\\d"]).spec() == \
        'root ::= "a\\"b" | "c\\\\d"'
    strict = StructuredOutputsParams(json=PERSON, disable_additional_properties=True)
    assert json.loads(strict.spec())["additionalProperties"] is False
    compact = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    assert compact.key()[2] is False and as_dict.key()[2] is True


@pytest.mark.parametrize(("params", "message"), [
    (StructuredOutputsParams(regex="(abc"), "regex into a grammar: .*parenthesis"),
    (StructuredOutputsParams(json={"type": "objx"}), "json schema into a grammar: .*objx"),
    (StructuredOutputsParams(json="{bad"), "Invalid JSON grammar specification"),
    (StructuredOutputsParams(grammar="root ::= foo"), "grammar specification .*foo"),
    (StructuredOutputsParams(grammar="start: foo"), "grammar specification .*foo"),
    (StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 3}}}), "not supported by xgrammar: multipleOf"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(json={"type": "string", "format": "color"}), "format 'color'"),
])
def test_invalid_constraints_are_value_errors(params: StructuredOutputsParams,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(params)


# ---- manager, bitmask, gate (real tokenizer, no model) ------------------------------------

def _request(rid: str, prompt: list[int], so: StructuredOutputsParams | None) -> Request:
    params = SamplingParams(max_tokens=8, structured_outputs=so)
    return Request(rid, prompt, params, frozenset({EOS}), 8)


def _sampling(*requests: Request) -> list[Request]:
    """The requests as scheduled for a step that samples each (all tokens computed)."""
    for r in requests:
        r.num_computed_tokens = r.num_tokens
    return list(requests)


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1
            and 32 * w + b < VOCAB}


@pytest.fixture(scope="module")
def manager(smollm_tokenizer) -> StructuredOutputManager:
    mgr = StructuredOutputManager(smollm_tokenizer, VOCAB, [EOS], max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def test_bitmask_apply_and_advance(manager: StructuredOutputManager, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    r = _request("r", [5, 6, 7], StructuredOutputsParams(choice=["yes", "no"]))
    plain = _request("p", [5, 6, 7], None)
    manager.init_request(r)
    manager.init_request(plain)
    assert r.status == RequestStatus.WAITING_FOR_FSM and plain.status == RequestStatus.WAITING
    r.structured_output_request.compiled.result(timeout=30)
    assert manager.ready(r) and r.status == RequestStatus.WAITING
    go = manager.grammar_output(_sampling(plain, r))
    assert go is not None and go.req_ids == ["r"]
    allowed = _allowed(go.bitmask, 0)
    assert tok.encode("yes")[0] in allowed and tok.encode("no")[0] in allowed
    assert all("yes".startswith(t) or "no".startswith(t) for t in map(tok.decode, allowed))
    assert EOS not in allowed
    logits = torch.zeros(2, VOCAB)
    go.apply(logits, ["p", "r"])
    assert torch.equal(logits[0], torch.zeros(VOCAB))
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed
    padded = torch.zeros(1, VOCAB + 64)
    go.apply(padded, ["r"])
    assert set(torch.isfinite(padded[0]).nonzero().flatten().tolist()) == allowed
    assert manager.advance([(r, tok.encode("yes"))]) == []
    assert _allowed(manager.grammar_output(_sampling(r)).bitmask, 0) == {EOS}
    other = _request("o", [5], StructuredOutputsParams(choice=["yes", "no"]))
    manager.init_request(other)
    other.structured_output_request.compiled.result(timeout=30)
    assert manager.ready(other)
    rejected = manager.advance([(other, tok.encode("maybe"))])
    assert [req for req, _ in rejected] == [other] and "Failed to advance FSM" in rejected[0][1]


def test_scheduler_skips_requests_waiting_for_their_grammar(
        manager: StructuredOutputManager) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=256), KVCacheManager(32, 4, True))
    sched.gates.append(manager)
    so = StructuredOutputsParams(regex="[0-9]+")
    blocked = _request("blocked", [1, 2, 3], so)
    pending: Future = Future()
    blocked.structured_output_request = StructuredOutputRequest(so, so.key(), pending)
    blocked.status = RequestStatus.WAITING_FOR_FSM
    free = _request("free", [4, 5, 6], None)
    sched.add_request(blocked)
    sched.add_request(free)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["free"]
    assert list(sched.waiting) == [blocked] and blocked.status == RequestStatus.WAITING_FOR_FSM
    sched.update_from_output(out, {"free": [9]})
    donor = _request("donor", [1], so)
    manager.init_request(donor)
    pending.set_result(donor.structured_output_request.compiled.result(timeout=30))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["free", "blocked"]
    assert blocked.status == RequestStatus.RUNNING
    assert blocked.structured_output_request.grammar is not None


# ---- end to end on the bundled model ------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20,
               max_num_seqs=8)


def _chat(llm: LLM, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def test_constrained_generation_mixed_batch(llm: LLM) -> None:
    def greedy(so: dict, max_tokens: int = 40) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)

    prompts = [_chat(llm, "Describe a person as JSON."), _chat(llm, "Is the sky blue?"),
               _chat(llm, "Give me a phone number."), _chat(llm, "What is the capital of France? Answer in JSON."),
               _chat(llm, "What is 6 times 7?")]
    params = [greedy({"json": PERSON}), greedy({"choice": ["yes", "no", "maybe"]}),
              greedy({"regex": r"\d{3}-\d{4}"}), greedy({"json_object": True}),
              greedy({"grammar": 'root ::= "The answer is " [0-9]+ "."'}, 12)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    person = json.loads(outs[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str)
    assert len(person["name"]) <= 12 and isinstance(person["age"], int)
    assert outs[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{3}-\d{4}", outs[2].text)
    capital = json.loads(outs[3].text)
    assert isinstance(capital, dict) and "Paris" in capital.values()
    assert re.fullmatch(r"The answer is [0-9]+\.", outs[4].text)
    assert outs[0].token_ids[-1] == EOS or outs[0].text.endswith("}")


def test_invalid_constraint_rejected_before_scheduling(llm: LLM) -> None:
    with pytest.raises(ValueError, match="regex into a grammar"):
        llm.generate("hi", SamplingParams(structured_outputs={"regex": "(abc"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_compile_failure_finishes_request_with_final_output(llm: LLM) -> None:
    engine = llm.engine
    outputs: list[RequestOutput] = []
    params = SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]+"},
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("doomed", [1, 2, 3], params, outputs.append)
    request = engine.scheduler.requests["doomed"]
    assert request.status == RequestStatus.WAITING_FOR_FSM
    failed: Future = Future()
    failed.set_exception(RuntimeError("compiler crashed"))
    request.structured_output_request.compiled = failed
    while engine.has_unfinished_requests():
        engine.step()
    (final,) = outputs
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == [] and request.status == RequestStatus.FINISHED_ABORTED
    assert engine.kv_cache_manager.usage() == 0.0


class EndTokenReasoner:
    """Reasoning ends once `end_id` has been generated (a one-token `</think>`)."""

    def __init__(self, end_id: int) -> None:
        self.end_id = end_id

    def is_reasoning_end(self, input_ids: list[int]) -> bool:
        return self.end_id in input_ids


def test_constraint_applies_only_after_reasoning_ends(llm: LLM) -> None:
    prompt = _chat(llm, "Is the sky blue?")
    prompt_ids = llm.get_tokenizer().encode(prompt)
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6),
                        use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i, t in enumerate(free) if i >= 1 and t not in prompt_ids)
    mgr = llm.engine.structured_output_manager
    mgr.set_reasoner(EndTokenReasoner(free[k]))
    try:
        out = llm.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=k + 8,
            structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)[0].outputs[0]
    finally:
        mgr.set_reasoner(None)
    assert out.token_ids[:k + 1] == free[:k + 1]
    answer = llm.get_tokenizer().decode(out.token_ids[k + 1:], skip_special_tokens=True)
    assert answer in ("yes", "no") and out.finish_reason == "stop"


# ---- whitespace, compile failures, configuration ------------------------------------------

@pytest.fixture(scope="module")
def backend(smollm_tokenizer) -> XgrammarBackend:
    return XgrammarBackend(smollm_tokenizer, VOCAB, [EOS])


def test_json_whitespace_is_bounded(backend: XgrammarBackend) -> None:
    free = backend.compile(StructuredOutputsParams(json=PERSON).key())
    m = xgr.GrammarMatcher(free)
    assert m.accept_string('{\n    "name"')
    assert not xgr.GrammarMatcher(free).accept_string("{" + "\n" * 64)
    obj = backend.compile(StructuredOutputsParams(json_object=True).key())
    assert not xgr.GrammarMatcher(obj).accept_string('{"a":' + " " * 64)
    compact = backend.compile(StructuredOutputsParams(json_object=True,
                                                      disable_any_whitespace=True).key())
    assert not xgr.GrammarMatcher(compact).accept_string("{\n")
    assert xgr.GrammarMatcher(compact).accept_string('{"a": 1}')


@pytest.mark.parametrize("grammar", ["root ::= a\na ::= a", "root ::= [^\\x00-\\U0010FFFF]"])
def test_grammar_that_accepts_nothing_fails_to_compile(manager: StructuredOutputManager,
                                                       grammar: str) -> None:
    params = StructuredOutputsParams(grammar=grammar)
    validate(params)  # it parses ...
    with pytest.raises(ValueError, match="accepts no output"):  # ... but cannot compile
        manager.compile_future(params).result(timeout=60)


@pytest.mark.parametrize(("so", "prefix"), [
    ({"json": PERSON}, ""), ({"json": PERSON}, '{"na'), ({"json": PERSON}, '{"name": "Bo'),
    ({"json": PERSON}, '{"name": "Bo",\n  "age": 1'),
    ({"json_object": True}, '{"a": [{"b": [1, 2, {"c": "xx'), ({"json_object": True}, '{"a": tr'),
    ({"json_object": True}, '{"a": -1.5e'), ({"json_object": True}, '{"k": "v",'),
])
def test_completion_finishes_the_document(backend: XgrammarBackend, so: dict,
                                          prefix: str) -> None:
    m = xgr.GrammarMatcher(backend.compile(StructuredOutputsParams(**so).key()),
                           override_stop_tokens=[EOS])
    assert m.accept_string(prefix)
    ids = backend.closer.completion(m)
    assert ids is not None and ids[-1] == EOS and len(ids) <= 24
    text = backend.closer.tokenizer.decode(ids[:-1])
    doc = json.loads(prefix + text)
    if "json" in so:
        assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)
    assert not m.is_completed() and m.accept_string(text) and m.is_completed()  # unchanged


def test_structured_outputs_config_validation() -> None:
    from sous.config.engine_args import engine_config_from_kwargs, parse_serve_args

    assert StructuredOutputsConfig.from_dict({"backend": "xgrammar", "disable_fallback": True})
    for bad, message in [({"backend": "guidance"}, "backend 'guidance' is not supported"),
                         ({"disable_any_whitespac": True}, "unknown field.*disable_any_whitespac"),
                         ({"enable_in_reasoning": 1}, "enable_in_reasoning must be a bool"),
                         ({"reasoning_parser_plugin": "p.py"}, "reasoning_parser_plugin")]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsConfig.from_dict(bad)
        with pytest.raises(SystemExit) as info:
            parse_serve_args(["--structured-outputs-config", json.dumps(bad)])
        assert info.value.code == 2
    with pytest.raises(ValueError, match="structured_outputs_config=.*unknown reasoning parser"):
        engine_config_from_kwargs(structured_outputs_config={"reasoning_parser": "nope"})
    engine, server = parse_serve_args(["--structured-outputs-config",
                                       '{"reasoning_parser": "deepseek_r1"}'])
    assert server.reasoning_parser == "deepseek_r1"
    assert engine.structured_outputs_config == {"reasoning_parser": "deepseek_r1"}


def test_config_sets_reasoner_and_defaults(smollm_tokenizer) -> None:
    config = StructuredOutputsConfig(reasoning_parser="deepseek_r1", enable_in_reasoning=True,
                                     disable_any_whitespace=True)
    mgr = StructuredOutputManager(smollm_tokenizer, VOCAB, [EOS], 4, config=config)
    assert mgr.reasoner is not None and mgr.enable_in_reasoning
    assert mgr.validate(StructuredOutputsParams(json=PERSON))[2] is False
    mgr.set_reasoner(None)
    assert mgr.enable_in_reasoning
    mgr.shutdown()


# ---- finishing within max_tokens (bundled model) ------------------------------------------

def test_json_finishes_within_max_tokens(llm: LLM) -> None:
    prompt = _chat(llm, "Give me a JSON object describing a cat.")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                             structured_outputs={"json_object": True}) for s in range(8)]
    for out in llm.generate([prompt] * 8, params, use_tqdm=False):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and len(o.token_ids) <= 40, o.text
        assert isinstance(json.loads(o.text), dict)
    (tiny,) = llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=3, structured_outputs={"json": PERSON}), use_tqdm=False)
    assert tiny.outputs[0].finish_reason == "length" and len(tiny.outputs[0].token_ids) == 3


def test_offline_structured_outputs_config_compact_json() -> None:
    compact = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20,
                  max_num_seqs=4, structured_outputs_config={"disable_any_whitespace": True})
    try:
        prompt = _chat(compact, "Describe a person as JSON.")
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                 structured_outputs={"json": PERSON}) for s in range(4)]
        for out in compact.generate([prompt] * 4, params, use_tqdm=False):
            text = out.outputs[0].text
            assert "\n" not in text and json.loads(text)["age"] >= 0, text
    finally:
        compact.engine.shutdown()
