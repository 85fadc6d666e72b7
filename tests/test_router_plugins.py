"""The router's plugins and config, one by one (llm-d semantics), and `sous route`'s exit 2
on a bad config."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sous.router.config import parse_router_config
from sous.router.framework import (
    ROLE_LABEL,
    CycleState,
    Endpoint,
    EndpointMetrics,
    PrefixMatchInfo,
    RouterRequest,
    SchedulingError,
)
from sous.router.plugins.approx_prefix import prefix_hashes
from sous.router.plugins.registry import RouterConfigError, build_plugin
from sous.router.pool import parse_endpoint, parse_metrics
from sous.router.scheduler import RouterScheduler

RECIPE_ROUTER = """
endpoint_picker:
  image: ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0
  ext_proc_port: 9002
  plugins:
  - type: prefix-based-pd-decider
    parameters:
      nonCachedTokens: 1
  - type: disagg-profile-handler
    parameters:
      deciders:
        prefill: prefix-based-pd-decider
  - type: prefill-filter
  - type: decode-filter
  - type: approx-prefix-cache-producer
    parameters:
      maxPrefixTokensToMatch: 131072
      lruCapacityPerServer: 1024
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: approx-prefix-cache-producer
  - type: queue-scorer
  - type: max-score-picker
  scheduling_profiles:
  - name: prefill
    plugins:
    - ref: prefill-filter
    - ref: max-score-picker
    - ref: prefix-cache-scorer
      weight: 2
    - ref: queue-scorer
      weight: 1
  - name: decode
    plugins:
    - ref: decode-filter
    - ref: max-score-picker
    - ref: prefix-cache-scorer
      weight: 2
    - ref: queue-scorer
      weight: 1
inference_pool:
  failure_mode: FailOpen
  match_labels:
    llm-d.ai/guide: pd-disaggregation
  target_ports: [8000, 8001]
"""

EPP_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: kv-cache-utilization-scorer
- type: load-aware-scorer
  parameters: {threshold: 10}
- type: random-picker
  name: rp
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: load-aware-scorer
  - pluginRef: rp
"""


def endpoint(port: int, role: str | None = None, waiting: float = 0, kv: float = 0) -> Endpoint:
    labels = {ROLE_LABEL: role} if role else {}
    return Endpoint(f"http://10.0.0.1:{port}", labels, True,
                    EndpointMetrics(waiting=waiting, kv_usage=kv))


def request(ids: list[int], model: str = "m") -> RouterRequest:
    return RouterRequest("r", "/v1/completions", {}, ids, model)


# ------------------------------------------------------------------ registry and config


def test_recipe_router_values_parse() -> None:
    config = parse_router_config(yaml.safe_load(RECIPE_ROUTER))
    assert list(config.profiles) == ["prefill", "decode"]
    decode = config.profiles["decode"]
    assert [f.type_name for f in decode.filters] == ["decode-filter"]
    assert [(s.type_name, w) for s, w in decode.scorers] == [("prefix-cache-scorer", 2.0),
                                                             ("queue-scorer", 1.0)]
    assert decode.picker.type_name == "max-score-picker"
    assert config.handler.type_name == "disagg-profile-handler"
    assert config.handler.decider.params.non_cached_tokens == 1
    assert config.producers[0].params.lru_capacity_per_server == 1024
    assert (config.failure_mode, config.target_ports) == ("FailOpen", [8000, 8001])


def test_endpoint_picker_config_form_and_single_profile_handler() -> None:
    config = parse_router_config(yaml.safe_load(EPP_CONFIG))
    assert config.handler.type_name == "single-profile-handler"
    assert config.profiles["default"].picker.name == "rp"
    assert config.failure_mode == "FailOpen"  # the helm chart's default
    busy, idle = endpoint(1, waiting=8, kv=0.5), endpoint(2, waiting=0, kv=0.0)
    result, _ = RouterScheduler(config).schedule(request([1, 2, 3]), [busy, idle])
    scores = result.results["default"].scores
    assert scores[idle.url] == pytest.approx(1.0 + 0.5)
    assert scores[busy.url] == pytest.approx(0.5 + 0.5 * (1 - 8 / 10))


@pytest.mark.parametrize("text, needle", [
    ("plugins: [{type: no-such-plugin}]\nschedulingProfiles: [{name: a, plugins: []}]",
     "unknown plugin type 'no-such-plugin'"),
    ("plugins: [{type: queue-scorer, parameters: {weight: 2}}]\n"
     "schedulingProfiles: [{name: a, plugins: []}]", "unknown parameter 'weight'"),
    ("plugins: [{type: prefix-based-pd-decider, parameters: {nonCachedTokens: many}}]\n"
     "schedulingProfiles: [{name: a, plugins: []}]", "'nonCachedTokens' must be"),
    ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: "
     "[{pluginRef: nope}]}]", "plugin 'nope' is not configured"),
    ("plugins: [{type: disagg-profile-handler, parameters: {deciders: {prefill: d}}}]\n"
     "schedulingProfiles: [{name: decode, plugins: []}]", "deciders.prefill names 'd'"),
    ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: []}]\n"
     "inference_pool: {failure_mode: FailSometimes}", "FailSometimes"),
])
def test_bad_configs_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(RouterConfigError, match=needle.replace("[", r"\[")):
        parse_router_config(yaml.safe_load(text))


def test_sous_route_exits_2_naming_unknown_plugin_and_parameter(tmp_path: Path) -> None:
    for text, needle in (
            (RECIPE_ROUTER.replace("type: queue-scorer", "type: queue-scorerz"),
             "unknown plugin type 'queue-scorerz'"),
            (RECIPE_ROUTER.replace("lruCapacityPerServer", "lruCapacityPerPod"),
             "unknown parameter 'lruCapacityPerPod'")):
        path = tmp_path / "router-values.yaml"
        path.write_text(text)
        r = subprocess.run([sys.executable, "-m", "sous.cli", "route", "--config", str(path),
                            "--endpoint", "decode=http://127.0.0.1:9"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr and str(path) in r.stderr


def test_parse_endpoint_and_metrics() -> None:
    [e] = parse_endpoint("prefill=http://127.0.0.1:8100/")
    assert (e.url, e.role, e.host_port) == ("http://127.0.0.1:8100", "prefill", "127.0.0.1:8100")
    assert parse_endpoint("http://h:1")[0].role is None
    ranks = parse_endpoint("decode=http://10.0.0.6", [8000, 8001])  # a pod's target ports
    assert [(r.url, r.role) for r in ranks] == [("http://10.0.0.6:8000", "decode"),
                                                ("http://10.0.0.6:8001", "decode")]
    for bad in ("decode=localhost", "decode=http://10.0.0.6"):
        with pytest.raises(RouterConfigError, match="--endpoint"):
            parse_endpoint(bad)
    m = parse_metrics('vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
                      'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
                      'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
                      'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="900"}'
                      ' 1.0\n')
    assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_blocks) == (3, 2, 0.25, 16, 900)


# ------------------------------------------------------------------ approx prefix producer


def test_prefix_hashes_chain_and_keep_the_partial_tail() -> None:
    a = prefix_hashes(list(range(150)), 64, "m")
    assert len(a) == 3  # 64 + 64 + 22
    assert prefix_hashes(list(range(128)) + [7] * 22, 64, "m")[:2] == a[:2]
    assert prefix_hashes(list(range(150)), 64, "m2")[0] != a[0]  # seeded by model (+ salt)
    b = prefix_hashes([0] * 64 + list(range(64, 150)), 64, "m")
    assert b[0] != a[0] and b[1] != a[1]  # chained: a changed block changes all after it
    assert len(prefix_hashes(list(range(1000)), 64, "m", max_blocks=4)) == 4


def producer(**params: object) -> object:
    return build_plugin("approx-prefix-cache-producer", None, params)


def test_approx_producer_records_picks_on_decode_and_prefill() -> None:
    config = parse_router_config(yaml.safe_load(RECIPE_ROUTER))
    p = config.producers[0]
    pre, d1, d2 = endpoint(1, "prefill"), endpoint(2, "decode"), endpoint(3, "decode")
    prompt = list(range(200))  # 4 blocks of 64 (16 clamped up to 64)
    state = CycleState()
    p.produce(request(prompt), state, [pre, d1, d2])
    assert state.get(p.name, d1) == PrefixMatchInfo(0, 4, 64)
    result, _ = RouterScheduler(config).schedule(request(prompt), [pre, d1, d2])
    state = CycleState()
    p.produce(request(prompt), state, [pre, d1, d2])
    picked = result.primary_endpoint
    other = d2 if picked is d1 else d1
    assert state.get(p.name, picked).match_blocks == 4
    assert state.get(p.name, pre).match_blocks == 4  # the prefill profile ran
    assert state.get(p.name, other).match_blocks == 0


def test_approx_producer_lru_evicts_tail_first_and_autotunes() -> None:
    p = producer(lruCapacityPerServer=3, autoTune=False)
    e = endpoint(1)
    hashes = prefix_hashes(list(range(64 * 5)), 64, "m")
    p.record(e, hashes)  # 5 blocks, capacity 3: the tail (blocks 3, 4) is evicted first
    assert set(p.lru[e.host_port]) == set(hashes[:3])
    assert hashes[4] not in p.hash_to_endpoints
    tuned = producer()
    e.metrics.block_size, e.metrics.num_blocks = 128, 2
    assert tuned.block_size([e]) == 128
    tuned.record(e, hashes)
    assert len(tuned.lru[e.host_port]) == 2  # capacity from vllm:cache_config_info
    e.metrics.block_size = 16
    assert tuned.block_size([e]) == 64  # llm-d's minimum


def test_approx_walk_counts_each_holder_until_no_endpoint_holds_a_block() -> None:
    p = producer(autoTune=False)
    e1, e2 = endpoint(1), endpoint(2)
    prompt = list(range(64 * 4))
    h = prefix_hashes(prompt, 64, "m")
    p.record(e1, h[:1])
    p.record(e2, h[1:3])
    state = CycleState()
    p.produce(request(prompt), state, [e1, e2])
    assert (state.get(p.name, e1).match_blocks, state.get(p.name, e2).match_blocks) == (1, 2)
    p2 = producer(autoTune=False)
    p2.record(e2, h[1:3])  # nobody holds block 0: nothing matches
    state = CycleState()
    p2.produce(request(prompt), state, [e1, e2])
    assert state.get(p2.name, e2).match_blocks == 0


# ------------------------------------------------------------------ scorers, pickers, filters


def scores(plugin_type: str, endpoints: list[Endpoint], state: CycleState | None = None,
           **params: object) -> list[float]:
    plugin = build_plugin(plugin_type, None, params)
    out = plugin.score(request([1]), state or CycleState(), endpoints)
    return [out[id(e)] for e in endpoints]


def test_queue_scorer_min_max() -> None:
    es = [endpoint(1, waiting=0), endpoint(2, waiting=5), endpoint(3, waiting=10)]
    assert scores("queue-scorer", es) == [1.0, 0.5, 0.0]
    assert scores("queue-scorer", [endpoint(1, waiting=4), endpoint(2, waiting=4)]) == [1, 1]


def test_kv_utilization_and_load_aware_scorers() -> None:
    es = [endpoint(1, kv=0.25, waiting=0), endpoint(2, kv=1.0, waiting=64),
          endpoint(3, waiting=500)]
    assert scores("kv-cache-utilization-scorer", es) == [0.75, 0.0, 1.0]
    assert scores("load-aware-scorer", es) == [0.5, 0.25, 0.0]


def test_prefix_scorer_ratio_and_length_weight() -> None:
    e1, e2 = endpoint(1), endpoint(2)
    state = CycleState()
    state.put("approx", e1, PrefixMatchInfo(3, 4, 64))
    plugin_cfg = {"prefixMatchInfoProducerName": "approx"}
    scorer = build_plugin("prefix-cache-scorer", None, plugin_cfg)
    assert scorer.score(request([1]), state, [e1, e2]) == {id(e1): 0.75, id(e2): 0.0}
    weighted = build_plugin("prefix-cache-scorer", None,
                            {**plugin_cfg, "matchLengthWeight": 0.5,
                             "matchLengthScaleTokens": 384})
    assert weighted.score(request([1]), state, [e1])[id(e1)] == pytest.approx(
        0.5 * 0.75 + 0.5 * (192 / 384) ** 2)


def test_max_score_picker_best_first_random_ties_and_random_picker() -> None:
    es = [endpoint(i) for i in range(4)]
    picker = build_plugin("max-score-picker", None, {"maxNumOfEndpoints": 2})
    picker.rng = random.Random(0)
    assert picker.pick([(es[0], 0.1), (es[1], 2.5), (es[2], 1.0), (es[3], 0.0)]) == \
        [es[1], es[2]]
    firsts = {picker.pick([(e, 1.0) for e in es])[0].url for _ in range(50)}
    assert len(firsts) > 1  # ties fall at random
    rp = build_plugin("random-picker", None, None)
    assert {rp.pick([(e, 9.0 if e is es[0] else 0.0) for e in es])[0].url
            for _ in range(50)} != {es[0].url}


def test_role_filters() -> None:
    es = [endpoint(1, "prefill"), endpoint(2, "decode"), endpoint(3, "both"), endpoint(4),
          endpoint(5, "encode-prefill")]
    pf = build_plugin("prefill-filter", None, None)
    df = build_plugin("decode-filter", None, None)
    assert [e.url[-1] for e in pf.filter(request([1]), CycleState(), es)] == ["1", "3", "5"]
    assert [e.url[-1] for e in df.filter(request([1]), CycleState(), es)] == ["2", "3", "4"]


# ------------------------------------------------------------------ deciders and handlers


def test_prefix_based_pd_decider_rule() -> None:
    config = parse_router_config(yaml.safe_load(RECIPE_ROUTER.replace(
        "nonCachedTokens: 1", "nonCachedTokens: 100")))
    decider = config.handler.decider
    d = endpoint(1, "decode")
    state = CycleState()
    assert not decider.disaggregate(request([0] * 500), state, d)  # no match info: no
    state.put("approx-prefix-cache-producer", d, PrefixMatchInfo(6, 8, 64))
    assert decider.disaggregate(request([0] * 500), state, d)  # 500 - 384 >= 100
    assert not decider.disaggregate(request([0] * 480), state, d)  # 96 uncached < 100
    assert not decider.disaggregate(request([0] * 99), state, d)  # shorter than N
    never = build_plugin("prefix-based-pd-decider", None, {"nonCachedTokens": 0})
    never.producer = "approx-prefix-cache-producer"
    assert not never.disaggregate(request([0] * 5000), state, d)


def test_disagg_handler_decode_first_then_prefill_when_decided() -> None:
    config = parse_router_config(yaml.safe_load(RECIPE_ROUTER))
    sched = RouterScheduler(config)
    p, d1, d2 = endpoint(1, "prefill"), endpoint(2, "decode"), endpoint(3, "decode")
    prompt = list(range(300))
    result, _ = sched.schedule(request(prompt), [p, d1, d2])
    assert result.primary == "decode" and result.primary_endpoint in (d1, d2)
    assert result.endpoint("prefill") is p  # nothing cached: disaggregate
    first = result.primary_endpoint
    result, _ = sched.schedule(request(prompt), [p, d1, d2])
    assert result.primary_endpoint is first  # the prefix went there (score 2 + 1 vs 1)
    assert result.endpoint("prefill") is None  # the whole prompt is cached there
    result, _ = sched.schedule(request(prompt + [5] * 70), [d1, d2])  # no prefill endpoint
    assert result.failed and "prefill" in result.failed
    with pytest.raises(SchedulingError):
        sched.schedule(request(prompt), [p])  # no decode endpoint: picking fails
