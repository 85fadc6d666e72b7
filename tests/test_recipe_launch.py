"""`sous recipe launch`: unsupported flags stop it (listed), --drop-unsupported says what it
drops, ports are remapped consistently, and an aggregated strategy comes up for real with the
bundled stand-in and answers a chat request."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

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
    bad = dict(unsupported_flags(["--data-parallel-size", "4", "--kv-cache-dtype", "fp8",
                                  "--block-size", "16", "--no-such-flag", "1"]))
    assert set(bad) == {"--data-parallel-size", "--no-such-flag"}
    assert bad["--no-such-flag"] == "unknown to sous serve"
    assert unsupported_flags(["--block-size", "16", "--max-num-seqs", "2"]) == []


def test_launch_stops_and_lists_unsupported_flags(capsys, tmp_path):
    code = main(["launch", "minimax-m2.7", "--strategy", "aggregated-data-expert-parallel",
                 "--target", "Latency", "--log-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    for flag in ("--data-parallel-size", "--enable-expert-parallel"):
        assert f"    {flag}: " in err
    for flag in ("--kv-cache-dtype", "--tool-call-parser", "--reasoning-parser",
                 "--enable-auto-tool-choice"):
        assert f"    {flag}: " not in err
    assert "Nothing was started" in err and "--drop-unsupported" in err
    assert list(tmp_path.iterdir()) == []


def test_pd_launch_remaps_ports_consistently(tmp_path):
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", variables=LOCAL)
    ports = _ports()
    specs, blocking = build_launch(plan, None, tmp_path, ports, drop_unsupported=True)
    assert blocking == {}
    assert [s.label for s in specs] == ["prefill rank 0", *(f"decode rank {i}" for i in range(4))]
    prefill, d0 = specs[0], specs[1]
    assert prefill.port == ports.mapping[8000] and d0.port == ports.mapping[8200]
    assert len({s.port for s in specs}) == 5
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(ports.mapping[5559])
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert prefill.log == tmp_path / "prefill-rank-0.log"
    assert d0.log == tmp_path / "decode-rank-0.log"
    cmd = list(d0.command)
    assert cmd[1:4] == ["-m", "sous.cli", "serve"] and "MiniMaxAI/MiniMax-M2.7" not in cmd[4:5]
    assert cmd[cmd.index("--served-model-name") + 1] == "MiniMaxAI/MiniMax-M2.7"
    assert "--max-model-len" not in cmd
    dropped = {f for f, _ in d0.dropped}
    assert "--data-parallel-rank" in dropped
    assert "--kv-events-config" in cmd  # supported: kept, pointed at the remapped port
    assert "RblnNixlConnector" in cmd[cmd.index("--kv-transfer-config") + 1]  # P/D: kept
    assert not dropped & set(cmd)
    assert any("--max-model-len 204800" in n for n in d0.notes)


def test_remapped_ports_inside_json_values(tmp_path):
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", variables=LOCAL)
    ports = _ports()
    specs, blocking = build_launch(plan, "/models/tiny", tmp_path, ports,
                                   drop_unsupported=False, stand_in_len=2048)
    assert set(blocking) == {s.label for s in specs}  # every process has unsupported flags
    cmd = list(specs[1].command)
    assert cmd[4] == "/models/tiny"
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://127.0.0.1:{ports.mapping[5557]}"
    assert events["topic"] == f"kv@127.0.0.1:{ports.mapping[8200]}@MiniMaxAI/MiniMax-M2.7"
    assert cmd[cmd.index("--data-parallel-rpc-port") + 1] == str(ports.mapping[5555])


def test_aggregated_comes_up_and_answers(capsys, tmp_path: Path):
    code = main(["launch", "minimax-m2.7", "--strategy", "aggregated-data-expert-parallel",
                 "--target", "Throughput", "--drop-unsupported", "--duration", "0.2",
                 "--log-dir", str(tmp_path), "--ready-timeout", "240"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "WARNING main: DROPPED --data-parallel-size" in err
    assert "chat reply: " in err and "all processes stopped" in err
    log = (tmp_path / "main.log").read_text()
    assert "Uvicorn running on http://127.0.0.1:" in log or "Application startup" in log
