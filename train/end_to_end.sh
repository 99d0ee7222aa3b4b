#!/usr/bin/env bash
# The whole pipeline on one GPU with the bundled SmolLM2: regenerate answers, extract, train drafts with
# speculators (EAGLE-3 unless KINDS says more), then measure them in vLLM on held-out prompts.
#   bash train/end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]
# DATA_DIR holds alpaca_seed_tasks.jsonl, sharegpt_dummy_conversations.json (training prompts)
# and vicuna_bench_questions.jsonl (held out: never regenerated, extracted or trained on).
# KINDS (default eagle3) lists the draft kinds to train and measure, e.g. KINDS=eagle3,dflash,dspark: each kind is
# trained on the same rows with the same epochs and flags into WORK/draft (eagle3) or WORK/draft-KIND, and measured
# with its own check_draft.py mode beside plain and n-gram decoding in one table (WORK/check_draft.json).
# STAGES (default extract,train,measure) runs some of them, e.g. one per call on a lent GPU; `online` trains each
# kind again on the same rows and epochs with every row's states pulled from `eagle-extract serve` (speculators'
# online mode; the spool on SPOOL, default /dev/shm) into WORK/draft-online[-KIND], and `measure` then measures those
# too (WORK/check_draft_online.json); speculators checkpoints every quarter epoch and by default resumes from its
# latest one, so rerunning a cut stage goes on.
# Smaller trial runs: MAX_NEW_TOKENS (answers), MAX_TOKENS (measured decoding), TRAIN_ARGS (e.g. --dry-run).
# MEASURE_ARGS adds check_draft.py options (e.g. "--temperature 0.7" for sampled decoding, "--num-spec 3": every
# method proposes that many tokens a step; by default each draft its own count); MODES its modes for the offline
# drafts (default plain,KINDS,ngram; the online drafts: their kinds alone).
# WORKERS (default 4) is speculators' --num-workers, its loader workers, offline and online alike: online each holds one
# row in flight. Each trainer's console goes to WORK/train[-online]-KIND.log too, and after the online stage
# train/trainer_wait.py compares the two trainers' wait for data per epoch (WORK/trainer_wait-KIND.json), with what
# the server's engine did meanwhile (its GET /metrics before and after: WORK/serve-metrics-KIND-{before,after}.txt).
# EXTRACT_ARGS adds eagle-extract options (e.g. "--engine-arg gpu_memory_utilization=0.5" to share the GPU).
# TEMPERATURE (default 0.7) samples the answers; lower is closer to the greedy decoding measured at the end
# (0: greedy, then COPIES=1). SYNTH=N adds N distinct prompts the model writes itself (synthesize_prompts.py).
set -euo pipefail
data=${1:?usage: end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]}
work=${2:?usage: end_to_end.sh DATA_DIR WORK [COPIES] [EPOCHS]}
copies=${3:-4}
epochs=${4:-10}
stages=${STAGES:-extract,train,measure}
workers=${WORKERS:-4}
wide=4000  # COLUMNS for the trainers: speculators' console (rich) would wrap a step's record; trainer_wait.py reads it whole
squeeze='s/ {8,}/   /g'  # the padding rich puts before each line's source location at that width
IFS=, read -r -a kinds <<< "${KINDS:-eagle3}"
for i in "${!kinds[@]}"; do  # checked before any stage: a misspelt kind would fail only after the extraction
  kinds[i]=${kinds[i]// /}
  case ${kinds[i]} in
    eagle3|peagle|dflash|dflash2|dspark) ;;
    mtp) echo "end_to_end.sh: KINDS=$KINDS: mtp trains only for a verifier with MTP weights, which SmolLM2 has not" >&2
         exit 1 ;;
    *) echo "end_to_end.sh: KINDS=$KINDS: unknown kind '${kinds[i]}'; use eagle3, peagle, dflash, dflash2 or dspark" >&2
       exit 1 ;;
  esac
done
mkdir -p "$work"
step() { printf '\n== %s  (%s)\n' "$1" "$(date +%T)"; }
folder() { [[ $1 == eagle3 ]] && echo "$work/$2" || echo "$work/$2-$1"; }  # folder KIND draft|draft-online
trainer() {  # trainer LOG OUT DRAFT KIND [speculators flags]: one training, its console also in LOG
  local log=$1 out=$2 draft=$3 kind=$4
  shift 4
  COLUMNS=$wide python3 train/train_draft.py "$out" --save-path "$draft" --speculator-type "$kind" \
    --draft-vocab-size 8192 --epochs "$epochs" --lr 1e-3 ${TRAIN_ARGS:-} -- --num-workers "$workers" \
    --loss-implementation eager --checkpoint-freq 0.25 "$@" 2>&1 | sed -u -E "$squeeze" | tee "$log"
}
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
# eager loss: speculators 0.9's fused Triton loss fails under torch 2.11's dynamo on the H200 image
# ("ListVariable ... is already tracked for mutation" in fused_kl_div_loss's backward).
for kind in "${kinds[@]}"; do
  step "train $kind"
  trainer "$work/train-$kind.log" "$work/out" "$(folder "$kind" draft)" "$kind"
done
fi

if [[ $stages == *online* ]]; then
step "train online: the same rows, every row's states pulled from eagle-extract serve"
# The dataset files of out/ (token ids, loss masks, token_freq.pt) without its states, then the server with
# out/'s layers and dtype, and the same trainer flags and epochs as the offline draft.
read -r layers seq dtype < <(python3 -c "import json, sys; m = json.load(open(sys.argv[1]))
print(','.join(map(str, m['aux_layer_ids'])), m['seq_length'], m['dtype'])" "$work/out/eagle_extract.json") \
  || { echo "end_to_end.sh: $work/out is not a complete output: run the extract stage first" >&2; exit 1; }
python3 -m eagle_extract --model "$model" --data "$work/out" --output "$work/out-online" --overwrite --states none \
  --layers "$layers" --seq-length "$seq" --dtype "$dtype"
port=${PORT:-8765}
python3 -m eagle_extract serve --model "$model" --layers "$layers" --seq-length "$seq" --dtype "$dtype" --port "$port" \
  --spool "${SPOOL:-/dev/shm}" --engine-arg gpu_memory_utilization=0.3 > "$work/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for (( waited = 0; ; waited += 2 )); do
  grep -q '^serving http' "$work/serve.log" && break
  if ! kill -0 $server 2>/dev/null || (( waited > 600 )); then
    tail -5 "$work/serve.log"; echo "end_to_end.sh: the server was not ready (its log: $work/serve.log)" >&2; exit 1
  fi
  sleep 2
done
grep '^serving http' "$work/serve.log"
metrics() {  # metrics FILE: the server's GET /metrics (no proxy), for what its engine did while a trainer ran
  local url="http://127.0.0.1:$port/metrics" why
  why=$(python3 -c "import sys, urllib.request as r
try:
    sys.stdout.write(r.build_opener(r.ProxyHandler({})).open(sys.argv[1], timeout=30).read().decode())
except Exception as exc:
    sys.exit(f'{type(exc).__name__}: {exc}')" "$url" 2>&1 > "$1") \
    || { rm -f "$1"; echo "end_to_end.sh: GET $url failed ($why): the trainers' wait has no server figures" >&2; }
}
for kind in "${kinds[@]}"; do
  metrics "$work/serve-metrics-$kind-before.txt"
  start=$(date +%s)
  trainer "$work/train-online-$kind.log" "$work/out-online" "$(folder "$kind" draft-online)" "$kind" \
    --vllm-endpoint "http://127.0.0.1:$port/v1" --hidden-states-backend file
  echo "online training, $kind: $(( $(date +%s) - start )) s"
  metrics "$work/serve-metrics-$kind-after.txt"
  if [ -f "$work/train-$kind.log" ]; then  # a figure, not a stage: its failure stops nothing
    scraped=("$work/serve-metrics-$kind-before.txt" "$work/serve-metrics-$kind-after.txt")
    [[ -f ${scraped[0]} && -f ${scraped[1]} ]] && moved=(--server "${scraped[@]}") || moved=()
    python3 train/trainer_wait.py "$work/train-$kind.log" "$work/train-online-$kind.log" ${moved[@]+"${moved[@]}"} \
      --json "$work/trainer_wait-$kind.json" || echo "end_to_end.sh: no comparison of the trainers' wait for data" >&2
  fi
done
trap - EXIT
kill -TERM $server 2>/dev/null || true
wait $server || { tail -5 "$work/serve.log"; echo "end_to_end.sh: the server ended with an error" >&2; exit 1; }
tail -3 "$work/serve.log"
fi

if [[ $stages == *measure* ]]; then
step "measure on held-out prompts"
for trained in draft draft-online; do  # the offline drafts, and the online ones where that stage ran
  drafts=() present=() missing=()
  for kind in "${kinds[@]}"; do
    dir=$(folder "$kind" $trained)
    if [ -d "$dir" ]; then present+=("$kind"); else missing+=("$dir"); fi
  done
  [[ $trained == draft-online && ${#present[@]} -eq 0 ]] && continue  # the online stage did not run
  if (( ${#missing[@]} )); then
    echo "end_to_end.sh: no trained draft in ${missing[*]}: run the train (or online) stage for KINDS=${KINDS:-eagle3}" >&2
    exit 1
  fi
  for kind in "${present[@]}"; do
    drafts+=(--draft "$(python3 -c "import sys; sys.path.insert(0, 'train'); from train_draft import servable_draft
print(servable_draft(sys.argv[1]))" "$(folder "$kind" $trained)")")
  done
  measured=$(IFS=,; echo "${present[*]}")
  if [[ $trained == draft ]]; then
    modes=${MODES:-plain,$measured,ngram}
  else
    modes=$measured  # plain and n-gram decoding do not depend on the draft: measured with the offline drafts
  fi
  python3 train/check_draft.py --verifier "$model" "${drafts[@]}" \
    --prompts "$data/vicuna_bench_questions.jsonl" --max-tokens "${MAX_TOKENS:-256}" --batch 8 \
    --engine-arg gpu_memory_utilization=0.25 --modes "$modes" --json "$work/check_${trained/-/_}.json" ${MEASURE_ARGS:-}
done
fi
