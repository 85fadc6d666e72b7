"""`sous recipe list | show | plan | check`: output facts and exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from sous import cli as top_cli
from sous.recipes.catalog import list_recipes, shipped_names
from sous.recipes.cli import main
from test_recipe_compose import toy_recipe

# (name, strategy, target, variant) of every option of every shipped recipe.
SHIPPED_OPTIONS = [(lr.name, s.slug, o.target, s.variant or lr.recipe.variant)
                   for lr in list_recipes() for s in lr.recipe.strategies for o in s.options]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def toy_path(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy_recipe()))
    return str(path)


def test_list(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:5] == ["NAME", "MODEL", "BADGES", "CONTEXT", "STRATEGIES"]
    (row,) = [r for r in rows if r.split()[0] == "minimax-m2.7"]
    for fact in ("minimax-m2.7", "MiniMaxAI/MiniMax-M2.7", "MoE", "230B", "204,800",
                 "aggregated-data-expert-parallel", "aggregated-pipeline-parallel",
                 "prefill-decode-disaggregated"):
        assert fact in row
    code, out, _ = run(capsys, "list", "--format", "json")
    (entry,) = [e for e in json.loads(out) if e["name"] == "minimax-m2.7"]
    assert entry["context"] == 204800 and "vllm-rbln" in entry["badges"]


def test_list_shows_every_shipped_recipe():
    """`python -m sous.cli recipe list`: one row per shipped recipe, A.X-K2 and MiniMax-M2.7
    among them, as installed (package data)."""
    out = subprocess.run([sys.executable, "-m", "sous.cli", "recipe", "list"], check=True,
                         capture_output=True, text=True).stdout
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert list(rows) == shipped_names()
    assert {"ax-k2", "minimax-m2.7"} <= set(rows)
    for fact in ("skt/A.X-K2", "MoE", "688B", "262,144", "aggregated-data-expert-parallel",
                 "aggregated-pipeline-parallel", "prefill-decode-disaggregated"):
        assert fact in rows["ax-k2"]
    assert "MiniMaxAI/MiniMax-M2.7" in rows["minimax-m2.7"]


def test_list_json_every_shipped_recipe(capsys):
    code, out, _ = run(capsys, "list", "--format", "json")
    entries = {e["name"]: e for e in json.loads(out)}
    assert code == 0 and list(entries) == shipped_names()
    ax = entries["ax-k2"]
    assert ax["model"] == "skt/A.X-K2" and ax["context"] == 262144 and "688B" in ax["badges"]
    assert ax["strategies"] == ["aggregated-data-expert-parallel", "aggregated-pipeline-parallel",
                                "prefill-decode-disaggregated"]


def test_show_en(capsys):
    code, out, _ = run(capsys, "show", "minimax-m2.7")
    assert code == 0
    assert "Mixture-of-Experts LLM served on RBLN-CR13" in out  # text.en.sub
    assert "<code>" not in out and "--data-parallel-size" in out  # strategyNote, tags stripped
    assert "prefill-decode-disaggregated: Prefill/Decode disaggregated" in out
    assert "2 nodes" in out
    assert "Latency     4 NPUs  RBLN-CR13  verified 2026-10-07" in out
    assert "Throughput  4 NPUs  RBLN-CR13  verified 2026-10-07" in out
    assert "lmcache - KV Offload: off* (Off), cpu (LMCache (CPU)), rds (LMCache (RDS))" in out
    assert "spec_decode - Speculative Decoding: off* (Off), eagle3 (EAGLE-3), suffix (Suffix)" \
        in out
    assert "tool_calling - tool_calling: off, on*" in out
    assert ("recommended: lmcache=rds prefix_caching=on_sub_block reasoning_parser=on "
            "spec_decode=eagle3 tool_calling=on") in out
    assert "recommended: (none)" in out  # pipeline parallel has none
    assert "roles: prefill (1 ranks), decode (4 ranks); router after the servers" in out


def test_show_ko(capsys):
    code, out, _ = run(capsys, "show", "minimax-m2.7", "--lang", "ko")
    assert code == 0
    assert "RBLN-CR13에서 RBLN vLLM으로 서빙" in out
    assert "Data + Expert Parallel은 dense 경로를" in out
    assert "Mixture-of-Experts LLM served" not in out
    assert "verified 2026-10-07" in out


def test_show_axk2(capsys):
    code, out, _ = run(capsys, "show", "ax-k2")
    assert code == 0
    assert out.startswith("A.X-K2 (skt/A.X-K2) - recipe ax-k2\n")
    assert "Mixture-of-Experts LLM served on RBLN-CR13 with RBLN vLLM (NVFP4)" in out
    assert "variant: NVFP4 (published variants: FP8, NVFP4)" in out
    assert "context: 262,144 tokens" in out
    assert "Latency     8 NPUs  RBLN-CR13  verified 2026-10-07" in out
    assert "Throughput  8 NPUs  RBLN-CR13  verified 2026-10-07" in out
    assert "spec_decode - Speculative Decoding: off* (Off), eagle3 (EAGLE-3)\n" in out
    assert "roles: prefill (1 ranks), decode (8 ranks); router after the servers" in out
    code, out, _ = run(capsys, "show", "ax-k2", "--lang", "ko")
    assert code == 0 and "RBLN-CR13에서 RBLN vLLM으로 서빙(NVFP4)" in out
    assert "Data + Expert Parallel은 dense 경로를" in out


@pytest.mark.parametrize("name, slug, target, variant", SHIPPED_OPTIONS,
                         ids=["-".join(o[:3]) for o in SHIPPED_OPTIONS])
def test_plan_and_check_every_shipped_option(capsys, name, slug, target, variant):
    """`plan` in every format and `check` in both, for the recommended selection of every
    option of every shipped recipe; `check` exits 1 only when a process does not fit."""
    sel = ["--strategy", slug, "--target", target, "--recommended"]
    code, shell, _ = run(capsys, "plan", name, *sel)
    assert code == 0 and shell.startswith(f"# {name}: {slug} ({target})\n")
    code, out, _ = run(capsys, "plan", name, *sel, "--format", "json")
    doc = json.loads(out)
    assert code == 0 and (doc["recipe"], doc["strategy"], doc["target"]) == (name, slug, target)
    assert shell.count(f"\n{doc['processes'][0]['launcher']} {doc['model']} \\\n") == \
        len(doc["processes"])
    code, out, _ = run(capsys, "plan", name, *sel, "--format", "k8s")
    items = yaml.safe_load(out)["items"]
    containers = [c for i in items if i["kind"] == "Deployment"
                  for c in i["spec"]["template"]["spec"]["containers"]]
    assert code == 0 and len(containers) == len(doc["processes"])
    code, out, _ = run(capsys, "check", name, *sel, "--format", "json")
    rows = json.loads(out)
    assert rows and code == (1 if any(r["verdict"] == "does not fit" for r in rows) else 0)
    assert {r["inputs"]["weight_format"] for r in rows} == {variant}
    code, text, _ = run(capsys, "check", name, *sel)
    assert text.startswith(f"{name}: {slug} ({target}), memory fit per rank\n")
    assert text.count("  verdict ") == len(rows)


def test_show_synthetic_with_excluded(capsys, toy_path):
    code, out, _ = run(capsys, "show", toy_path, "--lang", "ko")
    assert code == 0 and "토이 모델 페이지" in out
    assert "excluded[0]: cache=on tools=off" in out
    assert "[Latency]" in out and "[Throughput]" in out  # options differ: shown per target


def test_plan_shell_default(capsys):
    code, out, _ = run(capsys, "plan", "minimax-m2.7", "--strategy",
                       "aggregated-data-expert-parallel", "--target", "Latency",
                       "--recommended", "--set", "spec_decode=suffix")
    assert code == 0
    assert "VLLM_ENGINE_READY_TIMEOUT_S=9600 \\\n" in out
    assert "vllm serve MiniMaxAI/MiniMax-M2.7 \\\n    --block-size 4096 \\\n" in out
    assert '"method": "suffix"' in out and "eagle3" not in out.split("# main")[1]
    assert "LMCACHE_STORAGE_PLUGINS=RDSBackend" in out


def test_plan_json_via_top_level_cli(capsys):
    code = top_cli.main(["recipe", "plan", "minimax-m2.7", "--strategy",
                         "prefill-decode-disaggregated", "--target", "Throughput",
                         "--var", "POD_IP=10.0.0.9", "EPP_HOST=epp.local", "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    assert doc["selection"]["lmcache"] == "off" and doc["router"] is not None
    decode = doc["processes"][1]
    assert decode["args"]["--data-parallel-address"] == "10.0.0.9"
    assert decode["args"]["--kv-events-config"]["endpoint"] == "tcp://epp.local:5557"


def test_plan_k8s(capsys):
    code, out, _ = run(capsys, "plan", "minimax-m2.7", "--strategy",
                       "aggregated-pipeline-parallel", "--format", "k8s",
                       "--accelerator-resource", "example.com/npu")
    assert code == 0
    doc = yaml.safe_load(out)
    (dep,) = doc["items"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"] == {"example.com/npu": "4"}
    assert "--pipeline-parallel-size" in c["args"]


@pytest.mark.parametrize("argv, needles", [
    (["plan", "minimax-m2.7", "--strategy", "nope"],
     ["unknown strategy 'nope'", "aggregated-data-expert-parallel", "prefill-decode-disaggregated"]),
    (["plan", "minimax-m2.7"], ["missing --strategy", "aggregated-pipeline-parallel"]),
    (["plan", "minimax-m2.7", "--strategy", "prefill-decode-disaggregated"],
     ["missing --target", "Latency, Throughput"]),
    (["plan", "minimax-m2.7", "--strategy", "aggregated-pipeline-parallel", "--target",
      "Latency"], ["unknown target 'Latency'", "valid: Throughput"]),
    (["plan", "minimax-m2.7", "--strategy", "aggregated-pipeline-parallel", "--set",
      "colour=red"], ["unknown axis 'colour'", "lmcache, prefix_caching, spec_decode"]),
    (["plan", "minimax-m2.7", "--strategy", "aggregated-pipeline-parallel", "--set",
      "spec_decode=mtp"], ["unknown value for spec_decode 'mtp'", "off, eagle3, suffix"]),
    (["plan", "minimax-m2.7", "--strategy", "prefill-decode-disaggregated", "--target",
      "Latency", "--var", "HOST=1"], ["unknown placeholder 'HOST'", "EPP_HOST, POD_IP"]),
    (["plan", "no-such", "--strategy", "x"],
     ["unknown recipe 'no-such'", "ax-k2", "minimax-m2.7"]),
    (["plan", "ax-k2", "--strategy", "aggregated-data-expert-parallel", "--target",
      "Throughput"], ["unknown target 'Throughput'", "valid: Latency"]),
    (["plan", "ax-k2", "--strategy", "prefill-decode-disaggregated", "--set",
      "spec_decode=suffix"], ["unknown value for spec_decode 'suffix'", "off, eagle3"]),
    (["show", "minimax-m2.7", "--lang", "fr"], ["no page text in 'fr'", "en, ko"]),
    (["check", "minimax-m2.7"], ["missing --strategy"]),
    (["check"], ["--model"]),
    (["check", "--model", "org/nope", "--max-model-len", "10"], ["known: MiniMaxAI/MiniMax-M2.7"]),
])
def test_errors_exit_2_listing_choices(capsys, argv, needles):
    code, _, err = run(capsys, *argv)
    assert code == 2
    for needle in needles:
        assert needle in err


def test_excluded_selection_exits_2_naming_the_entry(capsys, toy_path):
    code, _, err = run(capsys, "plan", toy_path, "--strategy", "pd", "--set", "cache=on",
                       "tools=off")
    assert code == 2 and "excluded[0] = {cache=on, tools=off}" in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "minimax-m2.7", "--strategy", "x", "--format", "xml"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_check_without_recipe_axk2(capsys):
    code, out, _ = run(capsys, "check", "--model", "skt/A.X-K2", "--block-size", "2048",
                       "--max-model-len", "262144")
    assert "KV bytes per token        85,888 B per rank" in out
    assert "KV cache per rank         21.1 GiB" in out
    assert "weights per rank" in out and "verdict" in out
    assert "largest --max-model-len" in out
    assert code == 1  # 688B parameters on one card: does not fit
    code, out, _ = run(capsys, "check", "--model", "skt/A.X-K2", "--block-size", "2048",
                       "--max-model-len", "163840", "-tp", "16")
    assert code == 0 and "KV cache per rank         13.3 GiB" in out and "FITS" in out


def test_check_json_and_device_memory(capsys):
    code, out, _ = run(capsys, "check", "--model", "MiniMaxAI/MiniMax-M2.7", "--kv-cache-dtype",
                       "fp8", "--block-size", "4096", "-dp", "4", "--device-memory", "96",
                       "--format", "json")
    (row,) = json.loads(out)
    assert code == 0 and row["kv_bytes_per_token"] == 126_976
    assert row["inputs"]["device_memory_bytes"] == 96 * 2**30
    assert row["verdict"] == "fits" and row["max_model_len_that_fits"] > 204800


def test_check_recipe_selection(capsys):
    code, out, _ = run(capsys, "check", "minimax-m2.7", "--strategy",
                       "prefill-decode-disaggregated", "--target", "Throughput", "--recommended")
    assert code == 0
    assert "prefill rank 0: MiniMaxAI/MiniMax-M2.7, FP8 weights, KV fp8, block 4096, TP1 PP4" in out
    assert "decode ranks 0-3:" in out and "126,976 B per rank" in out
    assert "+ 3 speculative tokens" in out
