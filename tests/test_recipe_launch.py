"""`sous recipe launch`: unsupported flags stop it (listed), --drop-unsupported says what it
drops, ports are remapped consistently (data parallel ranks' offsets included), plans are
scaled to the machine, the DP+EP strategy comes up for real with a tiny MoE stand-in and
answers a chat request, so does the PP strategy, and every P/D selection (pipeline-parallel
prefill ranks included) comes up with its router and answers through it."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from sous.recipes.catalog import load_recipe
from sous.recipes.cli import main
from sous.recipes.compose import compose
from sous.recipes.launch import PortMap, build_launch, unsupported_flags

RECIPE = load_recipe("minimax-m2.7")
LOCAL = {"POD_IP": "127.0.0.1", "EPP_HOST": "127.0.0.1"}


def _ports() -> PortMap:
    counter = itertools.count(20000)
    return PortMap(allocate=lambda: next(counter))


def test_unsupported_flags_from_the_engine_table():
    bad = dict(unsupported_flags(["--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8",
                                  "--data-parallel-size", "4", "--block-size", "16",
                                  "--pipeline-parallel-size", "4", "--no-such-flag", "1"]))
    assert set(bad) == {"--tensor-parallel-size", "--no-such-flag"}
    assert bad["--no-such-flag"] == "unknown to sous serve"
    assert unsupported_flags(["--block-size", "16", "--max-num-seqs", "2"]) == []


def test_launch_stops_and_lists_unsupported_flags(capsys, tmp_path):
    """Every flag of the shipped recipes runs; a recipe asking for what sous does not run
    (here `--model-impl transformers`) starts nothing and lists it."""
    from sous.recipes.catalog import catalog_dir

    text = (catalog_dir() / "minimax-m2.7.json").read_text()
    assert '"--model-impl vllm"' in text
    recipe = tmp_path / "recipe" / "minimax-m2.7.json"
    recipe.parent.mkdir()
    recipe.write_text(text.replace('"--model-impl vllm"', '"--model-impl transformers"'))
    logs = tmp_path / "logs"
    code = main(["launch", str(recipe), "--strategy", "prefill-decode-disaggregated",
                 "--target", "Latency", "--log-dir", str(logs)])
    err = capsys.readouterr().err
    assert code == 2
    assert "    --model-impl: running transformers' modelling code is not wired in" in err
    for flag in ("--kv-cache-dtype", "--tool-call-parser", "--reasoning-parser",
                 "--enable-auto-tool-choice", "--data-parallel-size", "--data-parallel-rank",
                 "--pipeline-parallel-size"):
        assert f"    {flag}: " not in err
    assert "Nothing was started" in err and "--drop-unsupported" in err
    assert not logs.exists() or list(logs.iterdir()) == []


@pytest.mark.parametrize("value, why", [("lots", "'lots' is not a number of GiB"),
                                        ("0", "'0': must be > 0")])
def test_bad_kv_cache_gib_stops_before_anything_starts(capsys, tmp_path, value, why):
    with pytest.raises(SystemExit) as info:
        main(["launch", "minimax-m2.7", "--strategy", "prefill-decode-disaggregated",
              "--target", "Latency", "--log-dir", str(tmp_path / "logs"),
              "--kv-cache-gib", value])
    assert info.value.code == 2
    assert f"argument --kv-cache-gib: {why}" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_pd_launch_remaps_ports_consistently(tmp_path):
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", variables=LOCAL)
    ports = _ports()
    specs, blocking = build_launch(plan, None, tmp_path, ports, drop_unsupported=False)
    assert blocking == {}
    assert [s.label for s in specs] == ["prefill rank 0", *(f"decode rank {i}" for i in range(4)),
                                        "router"]
    prefill, d0, router = specs[0], specs[1], specs[-1]
    assert prefill.port == ports.mapping[8000] and d0.port == ports.mapping[8200]
    assert len({s.port for s in specs}) == 6
    # The router runs the recipe's router-values.yaml as written, over every rank by role.
    assert router.entry and router.command[1:4] == ("-m", "sous.cli", "route")
    config = router.command[router.command.index("--config") + 1]
    assert "prefix-based-pd-decider" in Path(config).read_text()
    endpoints = [router.command[i + 1] for i, w in enumerate(router.command) if w == "--endpoint"]
    assert endpoints == [f"prefill=http://127.0.0.1:{prefill.port}",
                         *(f"decode=http://127.0.0.1:{s.port}" for s in specs[1:5])]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(ports.mapping[5559])
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert prefill.log == tmp_path / "prefill-rank-0.log"
    assert d0.log == tmp_path / "decode-rank-0.log"
    cmd = list(d0.command)
    assert cmd[1:4] == ["-m", "sous.cli", "serve"] and "MiniMaxAI/MiniMax-M2.7" not in cmd[4:5]
    assert cmd[cmd.index("--served-model-name") + 1] == "MiniMaxAI/MiniMax-M2.7"
    assert "--max-model-len" not in cmd
    dropped = {f for f, _ in d0.dropped}
    assert "--data-parallel-rank" not in dropped and "--enable-expert-parallel" not in cmd
    assert any("the stand-in model is dense" in n for n in d0.notes)  # no experts to split
    assert "--kv-events-config" in cmd  # supported: kept, pointed at the remapped port
    # vLLM adds the DP rank to the KV-events and NIXL side channel ports; the recipe's ports
    # count down from 5557 so that every rank lands on the router's 5557 (and on its map here).
    for rank, spec in enumerate(specs[1:5]):
        words = list(spec.command)
        assert words[words.index("--data-parallel-rank") + 1] == str(rank)
        events = json.loads(words[words.index("--kv-events-config") + 1])
        assert events["endpoint"] == f"tcp://127.0.0.1:{ports.mapping[5557] - rank}"
        side = int(spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert side + rank == ports.mapping[5659 + 2 * rank]
    assert "RblnNixlConnector" in cmd[cmd.index("--kv-transfer-config") + 1]  # P/D: kept
    assert not dropped & set(cmd)
    assert any("--max-model-len 204800" in n for n in d0.notes)


def test_scaled_to_this_machine_keeps_ranks_below_the_cap_and_says_so():
    from sous.recipes.scale import default_max_ranks, scale_plan

    ax = compose(load_recipe("ax-k2").recipe, "prefill-decode-disaggregated", "Latency",
                 variables=LOCAL)
    scaled, notes = scale_plan(ax, 2)
    assert [(p.role, p.rank) for p in scaled.processes] == [
        ("prefill", 0), ("decode", 0), ("decode", 1)]
    for p in scaled.processes[1:]:
        assert p.arg("--data-parallel-size").words == ("--data-parallel-size", "2")
    assert "decode: 8 ranks in the recipe, 2 here (--max-ranks 2)" in notes
    assert "decode rank 1: --data-parallel-size 8 -> 2 (--max-ranks 2)" in notes
    agg = compose(RECIPE.recipe, "aggregated-data-expert-parallel", "Latency")
    same, none = scale_plan(agg, 64)
    assert same == agg and none == []
    assert default_max_ranks(2) == 2 and default_max_ranks(64) == 32


def test_lmcache_cpu_pool_capped_at_the_kv_share(tmp_path):
    """The recipe's 10 GB LMCache CPU pool, filled in every engine worker (the P/D prefill's
    pipeline stages each have one), is capped at the machine's KV cache share, and says so."""
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency",
                   sets={"lmcache": "cpu"}, variables=LOCAL)
    specs, blocking = build_launch(plan, None, tmp_path, _ports(), drop_unsupported=False,
                                   kv_share_gib=1.5)
    assert blocking == {}
    prefill = specs[0]
    assert prefill.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "1.5"
    assert any(n.startswith("LMCACHE_MAX_LOCAL_CPU_SIZE=10.0 -> 1.5") for n in prefill.notes)
    big = build_launch(plan, None, tmp_path, _ports(), drop_unsupported=False,
                       kv_share_gib=16)[0][0]
    assert big.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "10.0"


def test_remapped_ports_inside_json_values(tmp_path):
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", variables=LOCAL)
    ports = _ports()
    specs, blocking = build_launch(plan, "/models/tiny", tmp_path, ports,
                                   drop_unsupported=False, stand_in_len=2048)
    assert set(blocking) <= {s.label for s in specs[:-1]}
    cmd = list(specs[1].command)
    assert cmd[4] == "/models/tiny"
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://127.0.0.1:{ports.mapping[5557]}"
    assert events["topic"] == f"kv@127.0.0.1:{ports.mapping[8200]}@MiniMaxAI/MiniMax-M2.7"
    assert cmd[cmd.index("--data-parallel-rpc-port") + 1] == str(ports.mapping[5555])


def test_aggregated_dp_ep_comes_up_with_a_moe_stand_in(capsys, tmp_path: Path):
    """The recipe's recommended DP+EP selection (LMCache RDS, sub-block prefix caching, with
    suffix drafts in place of its EAGLE-3 head for another model) runs without
    --drop-unsupported: two data parallel ranks (scaled down from 4) splitting a tiny
    MiniMax-M2's experts, answering a chat."""
    from tiny_models import make_tiny_minimax_m2

    stand_in = make_tiny_minimax_m2(tmp_path)
    code = main(["launch", "minimax-m2.7", "--strategy", "aggregated-data-expert-parallel",
                 "--target", "Throughput", "--recommended", "--set", "spec_decode=suffix",
                 "--duration", "0.2", "--stand-in", str(stand_in),
                 "--stand-in-max-model-len", "256", "--log-dir", str(tmp_path / "logs"),
                 "--kv-cache-gib", "0.5",
                 "--ready-timeout", "240", "--max-ranks", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "NOTE scaled to this machine: main: --data-parallel-size 4 -> 2" in err
    assert "DROPPED" not in err and "stand-in model is dense" not in err
    assert "chat reply: " in err and "all processes stopped" in err
    log = (tmp_path / "logs" / "main.log").read_text()
    for rank in (0, 1):
        assert f"Expert parallel: rank {rank} of 2 holds routed experts" in log


def test_dense_stand_in_leaves_expert_parallel_out_and_says_so(tmp_path: Path):
    plan = compose(RECIPE.recipe, "aggregated-data-expert-parallel", "Throughput")
    (spec,), blocking = build_launch(plan, None, tmp_path, _ports(), drop_unsupported=False)
    assert blocking == {} and "--enable-expert-parallel" not in spec.command
    assert "--data-parallel-size" in spec.command
    assert any("the stand-in model is dense" in n for n in spec.notes)


def test_aggregated_pipeline_parallel_comes_up(capsys, tmp_path: Path):
    """The recipe's PP selection, with LMCache RDS, suffix drafts and sub-block prefix
    caching, runs without --drop-unsupported: two stages (scaled down from 4) of the bundled
    stand-in's layers, each with its own KV cache share and LMCache engine."""
    code = main(["launch", "minimax-m2.7", "--strategy", "aggregated-pipeline-parallel",
                 "--target", "Throughput", "--set", "lmcache=rds", "spec_decode=suffix",
                 "prefix_caching=on_sub_block", "--duration", "0.2", "--log-dir", str(tmp_path),
                 "--kv-cache-gib", "0.5",
                 "--ready-timeout", "240", "--max-ranks", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "NOTE scaled to this machine: main: --pipeline-parallel-size 4 -> 2" in err
    assert "DROPPED" not in err and "chat reply: " in err and "all processes stopped" in err
    log = (tmp_path / "main.log").read_text()
    assert "Pipeline stage 1 of 2: decoder layers 0-14 of 30" in log
    assert "Pipeline stage 2 of 2: decoder layers 15-29 of 30" in log
    assert log.count("KV offload (LMCache RBLNLMCacheConnectorV1") == 2


def _pd_plans():
    """(recipe name, strategy slug, target, plan with LMCache's CPU tier) of every target of
    every shipped P/D strategy."""
    from sous.recipes.catalog import list_recipes

    for lr in list_recipes():
        for s in lr.recipe.strategies:
            if "prefill" in s.slug and "decode" in s.slug:
                for o in s.options:
                    yield lr.name, s.slug, o.target, compose(lr.recipe, s.slug, o.target,
                                                             sets={"lmcache": "cpu"},
                                                             variables=LOCAL)


def _pd_selections() -> list[tuple[str, str, str]]:
    """Each shipped P/D topology once: of a strategy's targets whose processes take the same
    flags (MiniMax's Latency and Throughput differ only in `--max-num-seqs` values), the first.
    `test_recipe_shipped` checks every target's commands, and the test below that they
    parse."""
    seen, out = set(), []
    for name, slug, target, plan in _pd_plans():
        shape = (name, slug, tuple((p.role, tuple(sorted(a.flag for a in p.args)))
                                   for p in plan.processes))
        if shape not in seen:
            seen.add(shape)
            out.append((name, slug, target))
    return out


def test_every_pd_target_launches_serve_commands_that_parse(tmp_path: Path):
    """Every target of every P/D strategy (also those `_pd_selections` leaves out of the
    end-to-end test): each `sous serve` command it would launch parses into engine and server
    configs, as at the start of the launched process."""
    from sous.config.engine_args import parse_serve_args

    parsed = 0
    for name, _, target, plan in _pd_plans():
        specs, blocking = build_launch(plan, None, tmp_path, _ports(), drop_unsupported=False)
        assert blocking == {}, (name, target)
        for spec in specs:
            if spec.command[1:4] == ("-m", "sous.cli", "serve"):
                parse_serve_args(list(spec.command[4:]), environ=dict(spec.env))
                parsed += 1
    assert parsed >= 2 * len(_pd_selections())


@pytest.mark.parametrize("name, strategy, target", _pd_selections())
def test_pd_launch_runs_the_router_and_answers_a_tool_chat(name: str, strategy: str,
                                                           target: str, tmp_path: Path):
    """The whole P/D topology (prefill ranks of pipeline stages with LMCache's CPU tier beside
    NIXL, decode ranks, then `sous route` with the recipe's router-values.yaml) comes up with
    every flag of the recipe, answers a chat with tools through the router, and stops cleanly
    on Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sous.cli", "recipe", "launch", name, "--strategy", strategy,
         "--target", target, "--set", "lmcache=cpu", "--no-probe", "--log-dir", str(tmp_path),
         "--kv-cache-gib", "0.5"],
        stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        url = None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("talk to the router: "):
                url = line.split(": ", 1)[1].strip()
                break
        assert url, "".join(lines)
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        reply = client.chat.completions.create(
            model=model, max_tokens=24, temperature=0, tools=tools,
            messages=[{"role": "user", "content": "What is the weather in Seoul?"}])
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        message = reply.choices[0].message
        assert message.content or message.tool_calls or getattr(message, "reasoning", None)
        routed = (tmp_path / "router-values.yaml").read_text()
        assert "prefix-based-pd-decider" in routed  # the recipe's file, as written
        prefill = (tmp_path / "prefill-rank-0.log").read_text()
        assert prefill.count("KV offload (LMCache RBLNLMCacheConnectorV1") == 2  # per stage
    finally:
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "all processes stopped" in rest
