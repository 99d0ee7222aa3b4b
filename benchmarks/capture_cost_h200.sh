#!/usr/bin/env bash
# Where the capture's cost goes at Kimi-K2.5's widths, and the writer against the disk (docs/performance.md;
# docs/results/NOTES_capture_cost.md and docs/results/NOTES_writer.md), on one GPU machine with
# vLLM installed:
#   scripts/gpu_run.sh PIECES bash benchmarks/capture_cost_h200.sh OUT [pinned] [stages] [writer]
#   pinned  seconds to pin 1 GiB host blocks in a fresh process, then again from PyTorch's cache
#   stages  throughput.py on tmpfs: Kimi-K2.5's text widths cut to 4 layers, 128 x 2,048 tokens, bf16 and FP8,
#           b also stopped short at each stage (--leave-out write,copy,store), 4 repetitions
#   writer  writer_vs_disk.py on the machine's disk (this folder), 20 GB of bf16 rows a repetition, 3 repetitions,
#           safetensors' save_file and the streamed writer without its early writeback beside it (20 GB fits in
#           an H200 host's RAM: each variant is timed through os.sync, but a disk may sustain less over runs longer
#           than the page cache)
set -euo pipefail
out=${1:?usage: capture_cost_h200.sh OUT [pinned] [stages] [writer]}
shift
mkdir -p "$out"
parts=${*:-pinned stages writer}
for part in $parts; do
  case $part in
    pinned) python3 - <<'EOF' | tee "$out/pinned.txt" ;;
import time, torch
torch.cuda.init()
def pin(n):
    blocks, took = [], []
    for _ in range(n):
        t = time.perf_counter()
        blocks.append(torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
        took.append(time.perf_counter() - t)
    return blocks, took
blocks, fresh = pin(8)
del blocks
_, cached = pin(8)
print("pin 1 GiB, fresh s:", " ".join(f"{x:.3f}" for x in fresh))
print("pin 1 GiB, from the cache s:", " ".join(f"{x:.6f}" for x in cached))
EOF
    stages) python3 benchmarks/throughput.py --dummy --model benchmarks/configs/kimi-k2.5-text --num-layers 4 \
              --layers 1,2,3 --prompts 128 --prompt-len 2048 --reps 4 --storage-dtypes model,fp8 \
              --leave-out write,copy,store --out /dev/shm/eagle-bench --json "$out/stages.json" 2>&1 \
              | grep -v -i warning | tail -16 | tee "$out/stages.txt" ;;
    writer) python3 benchmarks/writer_vs_disk.py --folder "$PWD/writer-vs-disk" --gb 20 --reps 3 --with-save-file \
              --without-early-writeback --json "$out/writer.json" 2>&1 | tee "$out/writer.txt" ;;
    *) echo "capture_cost_h200.sh: unknown part $part (pinned, stages, writer)" >&2; exit 2 ;;
  esac
done
