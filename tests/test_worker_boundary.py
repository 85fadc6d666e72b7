"""The engine-core <-> worker boundary: SchedulerOutput as plain data (new requests once,
then diffs), the worker's persistent input batch, the worker in another process (offline
and behind `sous serve`), and the seams later features plug into."""

from __future__ import annotations

import io
import os
import pickle
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from openai import OpenAI

from serve_process import sous_serve
from sous import LLM, SamplingParams
from sous.config.scheduler import SchedulerConfig
from sous.engine.input_batch import CachedRequestState, InputBatch
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.request import Request, RequestStatus
from sous.engine.scheduler import Scheduler
from sous.engine.scheduler_output import SchedulerOutput
from sous.engine.spec_decode.proposer import TargetStep

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:",
           "Once upon a time, in a small village,", "The sun rises in the",
           "Q: What is 2 + 2?\nA:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class _NoLiveObjects(pickle.Pickler):
    """Pickles like pickle.dumps but refuses scheduler Request objects and tensors."""

    def persistent_id(self, obj: object) -> None:
        assert not isinstance(obj, Request | torch.Tensor), f"live object {type(obj)}"
        return None


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _NoLiveObjects(buf).dump(obj)
    return buf.getvalue()


def _request(rid: str, n: int, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=8),
                   frozenset({0}), 8)


def test_scheduler_output_is_plain_data_new_once_then_diffs() -> None:
    kv = KVCacheManager(9, 4, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                  max_model_len=64), kv)
    a, b = _request("a", 6), _request("b", 6, first=50)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert pickle.loads(_dumps(out)).num_scheduled_tokens == {"a": 6, "b": 2}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    assert out.scheduled_new_reqs[0].prompt_token_ids == a.prompt_token_ids
    assert out.scheduled_new_reqs[0].block_ids == kv.get_block_ids("a")
    s.update_from_output(out, {"a": [7]})
    out = s.schedule()  # b continues its prefill, a decodes: diffs only
    assert not out.scheduled_new_reqs and out.num_scheduled_tokens == {"a": 1, "b": 4}
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b"] and cached.resumed_from_preemption == [False, False]
    assert cached.num_computed_tokens == [6, 2]
    assert cached.new_block_ids[0] == kv.get_block_ids("a")[2:]  # only the block added now
    _dumps(out)
    s.update_from_output(out, {"a": [7], "b": [9]})
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}


def test_preempted_request_resumes_with_its_new_block_table() -> None:
    kv = KVCacheManager(5, 4, enable_caching=False)  # 4 usable blocks
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                  max_model_len=64), kv)
    a, b = _request("a", 7), _request("b", 7, first=40)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": [5], "b": [6]})
    s.update_from_output(s.schedule(), {"a": [5], "b": [6]})  # 9 tokens each: 3 blocks
    out = s.schedule()
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    s.update_from_output(out, {"a": [5]})
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_from_preemption == [True]
    assert cached.new_block_ids[0] == kv.get_block_ids("b") and cached.num_computed_tokens == [0]
    assert out.finished_req_ids == {"a"}


def test_input_batch_rows_stay_dense() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks=4)
    for i in range(4):
        batch.add(CachedRequestState(f"r{i}", [i + 1] * (i + 2), GREEDY, [i], 0, [9]))
    batch.remove("r0")
    batch.remove("r2")
    batch.condense()
    assert batch.num_reqs == 2 and sorted(batch.req_id_to_index.values()) == [0, 1]
    row = batch.req_id_to_index["r3"]
    assert batch.token_ids[row, :6].tolist() == [4, 4, 4, 4, 4, 9]
    assert batch.block_table[row, :1].tolist() == [3] and int(batch.num_tokens[row]) == 6
    batch.add(CachedRequestState("r4", [7, 7], GREEDY, [5, 6], 1))
    batch.append_token(batch.req_id_to_index["r4"], 8)
    assert batch.token_ids[batch.req_id_to_index["r4"], :3].tolist() == [7, 7, 8]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_worker_out_of_process_offline(reference: list[list[int]]) -> None:
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20,
              distributed_executor_backend="mp", max_num_batched_tokens=7)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        with pytest.raises(AttributeError, match="worker process"):
            _ = llm.engine.runner
    finally:
        llm.engine.shutdown()


def _worker_pid(log: Path) -> int:
    """The worker's pid, from the server's start-up log."""
    import re

    m = re.search(r"Worker process (\d+) started", log.read_text())
    assert m, log.read_text()
    return int(m.group(1))


def test_server_with_worker_out_of_process(tmp_path: Path,
                                           reference: list[list[int]]) -> None:
    """`sous serve --distributed-executor-backend mp` answers exactly as in-process; when
    the worker dies the server fails the request, then exits with status 1, never hangs."""
    log = tmp_path / "serve.log"
    with sous_serve(["--dtype", "float32", "--max-model-len", "512",
                     "--distributed-executor-backend", "mp"], log) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[:3],
                                        max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
        assert texts == _decode(reference[:3])
        port = int(url.rsplit(":", 1)[1])
        server = psutil.Process(next(c.pid for c in psutil.net_connections("tcp")
                                     if c.laddr and c.laddr.port == port
                                     and c.status == "LISTEN"))
        os.kill(_worker_pid(log), signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - the request fails, it does not hang
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi",
                                      max_tokens=4, timeout=60)
        assert server.wait(timeout=30) == 1
    assert "worker process exited" in log.read_text()


def _decode(token_lists: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer

    from conftest import BUNDLED_GGUF, bundled_model_dir

    tok = AutoTokenizer.from_pretrained(bundled_model_dir(), gguf_file=BUNDLED_GGUF)
    return [tok.decode(t) for t in token_lists]


# ------------------------------------------------------------------------------ seams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)


def _decode_steps(llm: LLM, prompt_ids: list[int], n: int) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_runner_verifies_draft_tokens_at_several_positions(llm: LLM) -> None:
    """Logits at 1 + k positions of one request: correct drafts are all accepted plus a
    bonus token; a wrong draft is replaced by the model's own token."""
    from sous.engine.scheduler_output import NewRequestData

    runner = llm.engine.runner
    prompt = llm.get_tokenizer().encode("The capital of France is")
    expected = _decode_steps(llm, prompt, 7)
    n_blocks = (len(prompt) + 8 + 15) // 16
    blocks = list(range(1, 1 + n_blocks))  # the engine is idle: any blocks will do
    params = SamplingParams(temperature=0, max_tokens=8)
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("seam", prompt, [], params,
                                                            blocks, 0)],
                         num_scheduled_tokens={"seam": len(prompt)})
    assert runner.execute_model(so).sampled_token_ids == {"seam": expected[:1]}
    so = SchedulerOutput(num_scheduled_tokens={"seam": 4},
                         scheduled_spec_decode_tokens={"seam": expected[1:4]})
    so.scheduled_cached_reqs.add("seam", False, [], len(prompt))
    assert runner.execute_model(so).sampled_token_ids == {"seam": expected[1:5]}
    wrong = (expected[6] + 1) % 1000
    so = SchedulerOutput(num_scheduled_tokens={"seam": 3},
                         scheduled_spec_decode_tokens={"seam": [expected[5], wrong]})
    so.scheduled_cached_reqs.add("seam", False, [], len(prompt) + 4)
    assert runner.execute_model(so).sampled_token_ids == {"seam": expected[5:7]}
    runner.execute_model(SchedulerOutput(finished_req_ids={"seam"}))
    assert "seam" not in runner.requests and "seam" not in runner.input_batch.req_id_to_index


def test_model_returns_aux_hidden_states(llm: LLM) -> None:
    """The forward hands back the residual stream entering chosen layers (EAGLE-3's
    inputs) without changing its result."""
    runner = llm.engine.runner
    layers = runner.model.config.num_hidden_layers
    chosen = (2, layers // 2, layers - 3)
    captured: list[torch.Tensor] = []
    layer = runner.model.model.layers[chosen[1]]

    def spy(h: torch.Tensor, residual: torch.Tensor | None, *args: object) -> object:
        captured.append(h if residual is None else h + residual)
        return type(layer).forward(layer, h, residual, *args)

    steps: list[TargetStep] = []

    class Recorder:
        """A drafter that keeps each step's `TargetStep` and drafts nothing."""

        uses_target_step = True

        def propose(self, batch: object, sampled: object, target: TargetStep | None,
                    draft: bool = True) -> dict[str, list[int]]:
            assert target is not None
            steps.append(target)
            return {}

        def finish(self, req_ids: set[str]) -> None:
            pass

    ids = llm.get_tokenizer().encode("Hello there, general")
    plain = _decode_steps(llm, ids, 3)
    layer.forward = spy  # the model calls layer.forward directly: no module hooks
    runner.aux_hidden_state_layers = chosen
    runner.proposer = Recorder()
    try:
        assert _decode_steps(llm, ids, 3) == plain
        aux = steps[-1].aux_hidden_states
        assert len(aux) == 3 and len(steps) >= 3
        assert aux[0].shape == (len(steps[-1].inputs.token_ids), runner.model.config.hidden_size)
        torch.testing.assert_close(aux[1], captured[-1])
    finally:
        runner.aux_hidden_state_layers = ()
        runner.proposer = None
        del layer.forward


def test_waiting_for_remote_kv_holds_only_that_request() -> None:
    kv = KVCacheManager(32, 4, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                  max_model_len=64), kv)
    arrived: set[str] = set()

    class RemoteKV:
        def ready(self, request: Request) -> bool:
            if request.request_id in arrived:
                request.status = RequestStatus.WAITING
                return True
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return False

    s.gates.append(RemoteKV())
    a, b = _request("a", 5), _request("b", 5, first=30)
    s.add_request(a)
    s.add_request(b)
    arrived.add("b")
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["b"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    arrived.add("a")
    s.update_from_output(out, {"b": [3]})
    assert list(s.schedule().num_scheduled_tokens) == ["b", "a"]


def test_finish_hook_may_keep_blocks_until_released() -> None:
    kv = KVCacheManager(16, 4, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                  max_model_len=64), kv)
    kept: dict[str, list[int]] = {}

    class Lease:
        def request_finished(self, request: Request, block_ids: list[int]) -> bool:
            kept[request.request_id] = block_ids
            return True

    s.finish_hooks.append(Lease())
    s.add_request(_request("a", 9))
    s.update_from_output(s.schedule(), {"a": [1]})
    used = kv.usage()
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert "a" in s.delayed and kv.usage() == used and len(kept["a"]) == 3
    s.free_delayed("a")
    assert kv.usage() == 0 and not s.delayed


def test_step_inputs_gather_tokens_positions_and_logits_indices() -> None:
    from sous.engine.step_inputs import build_step_inputs

    batch = InputBatch(max_num_reqs=3, max_model_len=32, max_num_blocks=8)
    batch.add(CachedRequestState("p", list(range(10, 20)), GREEDY, [1, 2, 3], 4))  # mid-prefill
    batch.add(CachedRequestState("d", [5, 6, 7], GREEDY, [4], 3, [8]))  # decode + 2 drafts
    inputs = build_step_inputs(batch, ["p", "d"], {"p": 3, "d": 3}, {"d": [40, 41]})
    assert inputs.token_ids.tolist() == [14, 15, 16, 8, 40, 41]
    assert inputs.positions.tolist() == [4, 5, 6, 3, 4, 5]
    assert inputs.num_logits.tolist() == [0, 3] and inputs.logits_indices.tolist() == [3, 4, 5]
    assert np.array_equal(inputs.seq_lens, [7, 6])


def test_kv_hooks_wrap_every_layer_read_and_write(llm: LLM) -> None:
    """A connector's worker side is called per layer, in layer order: before the layer reads
    its cache, and after it has written the step's new rows (they are in the cache then)."""
    runner = llm.engine.runner
    layer_of = {id(c): i for i, c in enumerate(runner.kv_caches)}
    calls: list[tuple[str, int]] = []
    written: list[bool] = []

    class Recorder:
        def wait_for_layer_load(self, kv_cache: torch.Tensor) -> None:
            calls.append(("load", layer_of[id(kv_cache)]))

        def save_kv_layer(self, kv_cache: torch.Tensor) -> None:
            calls.append(("save", layer_of[id(kv_cache)]))
            written.append(bool(kv_cache.abs().sum() > 0))

    runner.kv_hooks = Recorder()
    try:
        _decode_steps(llm, llm.get_tokenizer().encode("Hooks see every layer"), 2)
    finally:
        runner.kv_hooks = None
    layers = len(runner.kv_caches)
    one_step = [(kind, i) for i in range(layers) for kind in ("load", "save")]
    assert len(calls) == 2 * len(one_step) and calls == one_step * 2  # prefill, then decode
    assert all(written)
