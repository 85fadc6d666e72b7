#!/usr/bin/env bash
# One-shot CUDA check, run from the repository root of a copy of this tree on a machine with an
# NVIDIA GPU and python3 + torch (CUDA build) installed, no network:
#
#   bash benchmarks/cuda_check.sh
#
# 1. installs the wheels carried in .whl/ (what the GPU machine lacks: transformers 5.24,
#    pydantic, fastapi, uvicorn, gguf, cbor2, pyzmq, xgrammar, openai, ...) into $CUDA_CHECK_SITE
#    (/tmp/site) and puts it and src/ on PYTHONPATH (sous is not installed);
# 2. prints the devices and versions;
# 3. runs tests/test_cuda.py (sous on cuda against transformers on cuda; stops at the first
#    failure), then the existing tests that reach the GPU by themselves through the default
#    `--device auto` (offline LLM and `sous serve` on tiny random checkpoints; no bundled GGUF,
#    Redis, LMCache, NIXL or browser needed).
#
# Output: everything printed goes to $OUT/cuda_check.log too, with JUnit XML per pytest run
# ($OUT/junit_cuda.xml, $OUT/junit_existing.xml) and the tests' server logs under $OUT/logs/.
# Exit status: 0 when both pytest runs pass, else the first failing one's status; 2: the wheels
# did not install, 3: an import failed, 4: torch sees no CUDA device (SOUS_CUDA_CHECK_DEVICE=cuda).
#
# Environment: OUT (default /tmp/out), PYTHON (python3), CUDA_CHECK_SITE (/tmp/site),
# CUDA_CHECK_WHEELS (.whl), CUDA_CHECK_TMP (/tmp/sous-cuda-check: pytest's --basetemp),
# CUDA_CHECK_X (-x: test_cuda.py stops at its first failure; set it empty to run them all),
# SOUS_CUDA_CHECK_DEVICE (cuda; `cpu` runs test_cuda.py's tests on the CPU, to check them
# where there is no GPU), SOUS_OPS_BUILD_DIR (a fresh /tmp folder: shows whether anything
# built sous' C++ CPU ops).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/out}"
PY="${PYTHON:-python3}"
SITE="${CUDA_CHECK_SITE:-/tmp/site}"
WHEELS="${CUDA_CHECK_WHEELS:-.whl}"
TMP_BASE="${CUDA_CHECK_TMP:-/tmp/sous-cuda-check}"
mkdir -p "$OUT" "$TMP_BASE"

export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SOUS_OPS_BUILD_DIR="${SOUS_OPS_BUILD_DIR:-/tmp/sous-ops-cuda-check}"

# Existing tests whose engine or server takes `--device auto` (cuda when available).
EXISTING=(
  tests/test_llama.py::test_greedy_generation_matches_transformers_generate
  tests/test_minimax_m2.py::test_greedy_generation_matches_transformers_generate
  tests/test_deepseek.py::test_engine_greedy_and_logprobs_match_transformers
  tests/test_kv_cache_dtype.py::test_engine_with_fp8_cache_matches_model_dtype
  tests/test_quant_loaders.py::test_llm_greedy_fp8_equals_dense_reference
  tests/test_serve_architectures.py
  tests/test_bench.py::test_bench_serve_against_sous
)

main() {
  local t0 rc_cuda=0 rc_existing=0
  t0=$(date +%s)
  touch "$TMP_BASE/.start"
  echo "== $(date -u +%FT%TZ) sous CUDA check in $(pwd) (git $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

  echo "== installing $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels from $WHEELS/ into $SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl; then
    echo "!! pip install of $WHEELS/*.whl failed"
    return 2
  fi
  export PYTHONPATH="$SITE:$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
  echo "   done in $(( $(date +%s) - t0 )) s; PYTHONPATH=$PYTHONPATH"

  echo "== nvidia-smi -L"
  nvidia-smi -L || echo "(nvidia-smi not available)"
  echo "== versions"
  local rc_versions=0
  "$PY" - <<'PYEOF' || rc_versions=$?
import importlib
import importlib.metadata as md
import os
import platform
import shutil
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: "
      f"{torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, capability {p.major}.{p.minor}, "
          f"{p.total_memory / 2**30:.1f} GiB, bf16: {torch.cuda.is_bf16_supported()}")
for dist in ("transformers", "huggingface-hub", "tokenizers", "safetensors", "numpy",
             "xgrammar", "triton", "pydantic", "fastapi", "uvicorn", "openai", "gguf"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} -- not installed")
for tool in ("gcc", "cc", "c++", "nvcc", "ninja"):
    print(f"{tool}: {shutil.which(tool)}")
for mod in ("sous.engine.llm", "sous.engine.async_llm", "sous.server.api_server", "sous.cli",
            "xgrammar", "openai"):
    importlib.import_module(mod)
print("imports ok; lmcache loaded:", "lmcache" in sys.modules, "nixl loaded:",
      any(m.startswith("nixl") for m in sys.modules))
if os.environ.get("SOUS_CUDA_CHECK_DEVICE", "cuda") == "cuda" and not torch.cuda.is_available():
    print("!! torch sees no CUDA device: tests/test_cuda.py would only be skipped")
    sys.exit(4)
PYEOF
  if [ "$rc_versions" -eq 4 ]; then return 4; fi
  if [ "$rc_versions" -ne 0 ]; then echo "!! the version/import check failed"; return 3; fi

  echo "== pytest tests/test_cuda.py (device ${SOUS_CUDA_CHECK_DEVICE:-cuda})"
  local t1
  t1=$(date +%s)
  timeout -k 10 200 "$PY" -m pytest ${CUDA_CHECK_X--x} -q -p no:cacheprovider --durations=15 \
    --basetemp="$TMP_BASE/cuda" --junitxml="$OUT/junit_cuda.xml" tests/test_cuda.py
  rc_cuda=$?
  echo "   test_cuda.py: exit $rc_cuda in $(( $(date +%s) - t1 )) s"

  echo "== pytest: existing tests that reach the GPU through --device auto"
  t1=$(date +%s)
  timeout -k 10 150 "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    --basetemp="$TMP_BASE/existing" --junitxml="$OUT/junit_existing.xml" "${EXISTING[@]}"
  rc_existing=$?
  echo "   existing tests: exit $rc_existing in $(( $(date +%s) - t1 )) s"

  echo "== sous C++ CPU ops build dir ($SOUS_OPS_BUILD_DIR):"
  ls -la "$SOUS_OPS_BUILD_DIR"/*.so 2>/dev/null || echo "   (no sous_ops.so there)"
  if [ -n "$(find "$SOUS_OPS_BUILD_DIR" -name '*.so' -newer "$TMP_BASE/.start" 2>/dev/null)" ]; then
    echo "   -> something built the C++ CPU ops during this run"
  else
    echo "   -> the C++ CPU ops were not built during this run"
  fi
  mkdir -p "$OUT/logs"
  (cd "$TMP_BASE" 2>/dev/null && find . -name '*.log' -size -2M -exec cp --parents {} "$OUT/logs/" \;)
  echo "== done in $(( $(date +%s) - t0 )) s: test_cuda.py exit $rc_cuda, existing tests exit $rc_existing"
  if [ "$rc_cuda" -ne 0 ]; then return "$rc_cuda"; fi
  return "$rc_existing"
}

main 2>&1 | tee "$OUT/cuda_check.log"
exit "${PIPESTATUS[0]}"
