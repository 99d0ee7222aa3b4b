#!/usr/bin/env bash
# The whole pipeline on one GPU with the bundled SmolLM2: regenerate answers, extract, train an
# EAGLE-3 draft with speculators, then measure it in vLLM on held-out prompts.
#   bash train/end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]
# DATA_DIR holds alpaca_seed_tasks.jsonl, sharegpt_dummy_conversations.json (training prompts)
# and vicuna_bench_questions.jsonl (held out: never regenerated, extracted or trained on).
# STAGES (default extract,train,measure) runs some of them, e.g. one per call on a lent GPU; speculators
# checkpoints every quarter epoch and by default resumes from its latest one, so rerunning a cut stage goes on.
# Smaller trial runs: MAX_NEW_TOKENS (answers), MAX_TOKENS (measured decoding), TRAIN_ARGS (e.g. --dry-run).
# MEASURE_ARGS adds check_draft.py options (e.g. "--temperature 0.7" for sampled decoding).
# EXTRACT_ARGS adds eagle-extract options (e.g. "--engine-arg gpu_memory_utilization=0.5" to share the GPU).
# TEMPERATURE (default 0.7) samples the answers; lower is closer to the greedy decoding measured at the end
# (0: greedy, then COPIES=1). SYNTH=N adds N distinct prompts the model writes itself (synthesize_prompts.py).
set -euo pipefail
data=${1:?usage: end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]}
work=${2:?usage: end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]}
copies=${3:-4}
epochs=${4:-10}
mkdir -p "$work"
stages=${STAGES:-extract,train,measure}
step() { printf '\n== %s  (%s)\n' "$1" "$(date +%T)"; }
model=$(python3 -c 'from eagle_extract.smollm2 import ensure_smollm2; print(ensure_smollm2())')

if [[ $stages == *extract* ]]; then
inputs=("$data/alpaca_seed_tasks.jsonl" "$data/sharegpt_dummy_conversations.json")
if [[ ${SYNTH:-0} -gt 0 ]]; then
  step "synthesize $SYNTH prompts"
  python3 train/synthesize_prompts.py "$work/synth.jsonl" --model "$model" --count "$SYNTH" \
    --held-out "$data/vicuna_bench_questions.jsonl" --engine-arg gpu_memory_utilization=0.4
  inputs+=("$work/synth.jsonl")
fi
step "prompts"
python3 train/build_prompts.py "$work/prompts.jsonl" --copies "$copies" "${inputs[@]}"

step "regenerate + extract"
python3 -m eagle_extract --model "$model" --data "$work/prompts.jsonl" --output "$work/out" --overwrite \
  --regenerate --temperature "${TEMPERATURE:-0.7}" --top-p 0.95 --max-new-tokens "${MAX_NEW_TOKENS:-512}" --seq-length 2048 --dtype bfloat16 ${EXTRACT_ARGS:-}
python3 -m eagle_extract verify "$work/out"
fi

if [[ $stages == *train* ]]; then
step "train"
# eager loss: speculators 0.9's fused Triton loss fails under torch 2.11's dynamo on the H200 image
# ("ListVariable ... is already tracked for mutation" in fused_kl_div_loss's backward).
python3 train/train_draft.py "$work/out" --save-path "$work/draft" --draft-vocab-size 8192 \
  --epochs "$epochs" --lr 1e-3 ${TRAIN_ARGS:-} -- --num-workers 4 --loss-implementation eager --checkpoint-freq 0.25
fi

if [[ $stages == *measure* ]]; then
step "measure on held-out prompts"
draft=$(python3 -c "import sys; sys.path.insert(0, 'train'); from train_draft import servable_draft; print(servable_draft('$work/draft'))")
python3 train/check_draft.py --verifier "$model" --draft "$draft" \
  --prompts "$data/vicuna_bench_questions.jsonl" --max-tokens "${MAX_TOKENS:-256}" --batch 8 \
  --engine-arg gpu_memory_utilization=0.25 --json "$work/check_draft.json" ${MEASURE_ARGS:-}
fi
