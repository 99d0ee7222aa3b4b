#!/usr/bin/env bash
# The disk-inclusive runs of docs/results/NOTES_capture_cost.md ("With the disk"), on one GPU machine
# with vLLM installed (scripts/gpu_run.sh PIECES bash benchmarks/disk_bound.sh OUT [PART ...]).
#   kimi    Kimi-K2.5's text widths cut to 4 layers, 128 x 2,048 tokens: bf16 and FP8 storage, the default
#           writer threads and 2, every b timed through os.sync(), the disk measured in the same runs
#   rows8k  the same model, 32 x 8,192-token rows under an 8 GiB host-memory budget (peak use, RSS)
#   llama   the Llama-3.1-8B shape, 128 x 1,024 tokens, bf16, with and without os.sync()
set -euo pipefail
out=${1:?usage: disk_bound.sh OUT [kimi] [rows8k] [llama]}
shift
parts=${*:-kimi rows8k llama}
bench() { python3 benchmarks/throughput.py --dummy --reps 3 --out /tmp/eagle-bench "$@"; }
kimi=(--model benchmarks/configs/kimi-k2.5-text --num-layers 4 --layers 1,2,3)
for part in $parts; do
  case $part in
    kimi) bench "${kimi[@]}" --prompts 128 --prompt-len 2048 --storage-dtypes model,fp8 --writer-threads 0,2 \
            --sync --json "$out/kimi.json" ;;
    rows8k) bench "${kimi[@]}" --prompts 32 --prompt-len 8192 --storage-dtypes model,fp8 --host-memory 8 \
              --sync --json "$out/rows8k.json" ;;
    llama) bench --model benchmarks/configs/llama-3.1-8b --prompts 128 --prompt-len 1024 --json "$out/llama.json"
           bench --model benchmarks/configs/llama-3.1-8b --prompts 128 --prompt-len 1024 --sync \
             --json "$out/llama-sync.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
