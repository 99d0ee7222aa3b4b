#!/usr/bin/env bash
# benchmarks/online.py on one GPU, inside scripts/gpu_run.sh (any release's lock, with gpu/requirements-train.lock's wheels):
# the bundled SmolLM2, or with dummy weights and SmolLM2's tokenizer the Llama-3.1-8B shape or Kimi-K2.5's text
# widths cut to 4 layers (kimi4l: bf16 experts, about 108 GB, so an H200; slots 1, 2, 3 and the final one; pass
# PROMPT_LEN=2048 for the rows of the offline figures at these widths); spools on tmpfs (/dev/shm) and on the machine's disk
# (the repository's folder).
#   LOCK=gpu/requirements-gpu-vllm-0.26.0.lock bash scripts/gpu_run.sh /tmp/pieces bash benchmarks/online_h200.sh smollm2|llama8b|kimi4l OUT [shm|disk|mooncake]
# CLIENTS=N: client processes (default 12, speculators' data-loader workers of one rank; 8 ranks keep 96 rows in flight);
# CLIENTS="96 48": each count in turn against the same server (one offline, one server start).
# ROWS, PROMPT_LEN, REPS: the rows, their tokens and the passes (default 256, 1,024 and 2); FP8=1: FP8 storage.
# EXPERTS=N: kimi4l with N of its 384 routed experts a layer (192: about 56 GB, so it fits an H100; the same widths
# and 8 experts a token).
# (one spool: a call of 600 s holds one; both without the third argument).  `mooncake`: the file transfer and
# `serve --transfer mooncake` (a mooncake_master on loopback TCP), both on tmpfs, no offline pass; it needs
# Mooncake's cp312 wheel in .whl/ too (mooncake_transfer_engine*.whl; it links libibverbs.so.1, which the
# image lacks: Debian's libibverbs1, libnl-3-200 and libnl-route-3-200 unpacked with `dpkg -x` into .whl/lib).
set -euo pipefail
which=${1:?smollm2, llama8b or kimi4l}
out=${2:?folder for the JSON}
only=${3:-both}
if [ "$only" = mooncake ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-extra .whl/mooncake_transfer_engine*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site-extra
  # The image has no libibverbs (Mooncake links it even for TCP): Debian's, unpacked into .whl/lib, when carried.
  [ -d .whl/lib ] && export LD_LIBRARY_PATH=$PWD/.whl/lib:${LD_LIBRARY_PATH:-}
fi
disk=$PWD/spool-disk
mkdir -p /dev/shm/spool "$disk"
dummy() {  # dummy MODEL CONFIG [LAYERS]: the config (cut to LAYERS layers, EXPERTS experts) and SmolLM2's tokenizer in MODEL
  mkdir -p "$1"
  python3 -c "import json, os, pathlib, shutil, sys; from eagle_extract.smollm2 import ensure_smollm2
config = json.load(open(sys.argv[2]))
if len(sys.argv) > 3:
    config['num_hidden_layers'] = int(sys.argv[3])
if os.environ.get('EXPERTS'):
    config['n_routed_experts'] = int(os.environ['EXPERTS'])
json.dump(config, open(sys.argv[1] + '/config.json', 'w'))
src = ensure_smollm2()
[shutil.copy(f, sys.argv[1]) for f in pathlib.Path(src).iterdir() if f.name.startswith('tokenizer') or f.suffix == '.jinja']" "$@"
}
case $which in
  llama8b) EXPERTS= dummy /tmp/llama-3.1-8b benchmarks/configs/llama-3.1-8b/config.json
           args=(--model /tmp/llama-3.1-8b --dummy) ;;
  kimi4l) dummy /tmp/kimi-k2.5-text-4l benchmarks/configs/kimi-k2.5-text/config.json 4
          if [ -n "${EXPERTS:-}" ]; then which+=-e$EXPERTS; fi
          args=(--model /tmp/kimi-k2.5-text-4l --dummy --extra='--layers 1,2,3') ;;
  smollm2) args=(--model smollm2) ;;
  *) echo "online_h200.sh: $which: give smollm2, llama8b or kimi4l" >&2; exit 1 ;;
esac
spools=(--spool /dev/shm/spool --spool "$disk")
[ "$only" = shm ] && spools=(--spool /dev/shm/spool)
[ "$only" = disk ] && spools=(--spool "$disk")
[ "$only" = mooncake ] && spools=(--spool /dev/shm/spool --mooncake --no-offline)
read -ra clients <<< "${CLIENTS:-12}"
args+=(--rows "${ROWS:-256}" --prompt-len "${PROMPT_LEN:-1024}" --reps "${REPS:-2}" --clients "${clients[@]}")
tag=$which-$only-c$(IFS=-; echo "${clients[*]}")-t${PROMPT_LEN:-1024}
case ${FP8:-0} in 1) args+=(--fp8) && tag+=-fp8 ;; 0) ;; *) echo "FP8=$FP8: give 1 or 0" >&2; exit 1 ;; esac
python3 benchmarks/online.py "${args[@]}" --dtype bfloat16 "${spools[@]}" \
  --json "$out/online-$tag.json" 2>&1 | tee "$out/online-$tag.log" | grep -v -i warning | tail -20
