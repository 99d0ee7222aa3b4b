#!/usr/bin/env bash
# benchmarks/cli_vs_prefill.py on one GPU at the Llama-3.1-8B shape (dummy weights, SmolLM2's tokenizer),
# inside scripts/gpu_run.sh:
#   LOCK=gpu/requirements-gpu-vllm-0.34.0.lock bash scripts/gpu_run.sh /tmp/pieces bash benchmarks/cli_h200.sh OUT [ROWS] [REPS]
# The data: ROWS conversations (default 1,000) of about 1,000 tokens, each the turns of 12 of the bundled
# sample conversations in a row, drawn with a fixed seed; the output on tmpfs (/dev/shm: 32 KiB a token
# in bf16 at this shape, so 1,000 rows take about 32 GB), so the disk is out of a's clock.
set -euo pipefail
out=${1:?usage: cli_h200.sh OUT [ROWS] [REPS]}
rows=${2:-1000}
reps=${3:-2}
model=/tmp/llama-3.1-8b
mkdir -p $model && cp benchmarks/configs/llama-3.1-8b/config.json $model/
python3 -c "import shutil, pathlib, sys; from eagle_extract.smollm2 import ensure_smollm2
src = ensure_smollm2()
[shutil.copy(f, sys.argv[1]) for f in pathlib.Path(src).iterdir() if f.name.startswith('tokenizer') or f.suffix == '.jinja']" $model
python3 -c "import json, random, sys
convs = json.load(open('eagle_extract/sample_data/sharegpt_dummy_conversations.json'))
rng = random.Random(0)
with open(sys.argv[2], 'w') as f:
    for i in range(int(sys.argv[1])):
        turns = [t for c in rng.sample(convs, 12) for t in c['conversations']]
        f.write(json.dumps({'id': f'synthetic_{i}', 'conversations': turns}) + '\n')" "$rows" /tmp/cli-h200.jsonl
python3 benchmarks/cli_vs_prefill.py --model $model --data /tmp/cli-h200.jsonl --dtype bfloat16 --reps "$reps" \
  --out /dev/shm/cli-h200 --engine-arg load_format=dummy --json "$out/cli-h200.json" 2>&1 \
  | tee "$out/cli-h200.log" | grep -v -i warning | tail -12
