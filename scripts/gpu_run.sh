#!/usr/bin/env bash
# On an air-gapped GPU machine: install the locked wheel set from carried pieces (once), set the
# environment the GPU runs need, then run a command (default: the GPU tests, tests/gpu).
#   bash scripts/gpu_run.sh PIECES [COMMAND ...]
# PIECES holds p1 ... pN from `scripts/offline_wheels.py split` (docs/install.md); when they also
# hold the wheels of gpu/requirements-train.lock or gpu/requirements-ray.lock, the training stage or Ray
# is installed too.
# LOCK=gpu/requirements-gpu-vllm-X.lock installs another release's set, in a folder of its own; its
# PIECES need hold only the wheels an earlier set on this machine did not bring (/tmp/wheels keeps them).
set -euo pipefail
pieces=${1:?usage: [LOCK=...] gpu_run.sh PIECES [COMMAND ...]}
shift
lock=${LOCK:-gpu/requirements-gpu.lock}
[ -f "$lock" ] || { echo "gpu_run.sh: LOCK=$lock: no such lock file (gpu/ has them)" >&2; exit 1; }
site=/tmp/site-$(basename "$lock" .lock)-$(sha256sum "$lock" | cut -c1-12)  # a changed lock installs anew
if [ ! -d "$site/vllm" ]; then
  python3 scripts/offline_wheels.py join "$pieces" /tmp/wheels --lock "$lock"
  python3 -m pip install -q --no-index --no-deps --require-hashes --no-compile --find-links /tmp/wheels \
    --target "$site" -r "$lock"
fi
# The training stage (speculators) and vLLM's Ray executor, each when its wheels came with these pieces or
# earlier ones (a wheel larger than a piece comes as NAME.whl.000, .001, ...).
for stage in train:speculators ray:ray; do
  stage_lock=gpu/requirements-${stage%%:*}.lock package=${stage#*:}
  if { compgen -G "$pieces/p*/$package-*.whl*" || compgen -G "/tmp/wheels/$package-*.whl"; } >/dev/null \
    && [ ! -d "$site/$package" ]; then
    python3 scripts/offline_wheels.py join "$pieces" /tmp/wheels --lock "$stage_lock"
    python3 -m pip install -q --no-index --no-deps --require-hashes --no-compile --find-links /tmp/wheels \
      --target "$site" -r "$stage_lock"
  fi
done
# The folder as a site directory, so its .pth files count (nvidia-cutlass-dsl's puts its packages on the path).
site_path=$(python3 -c "import site, sys; before = set(sys.path); site.addsitedir(sys.argv[1])
print(':'.join([sys.argv[1]] + [p for p in sys.path if p not in before and p != sys.argv[1]]))" "$site")
export PYTHONPATH=$site_path:$PWD PYTHONUNBUFFERED=1
# Settings the GPU runs needed (docs/install.md): no flashinfer, offline, spawned workers.
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The default: every GPU test (tests/gpu; pytest comes from the image, it is in no lock), results in one JSON.
# -p no:cacheprovider: no .pytest_cache written into the checkout.
if [ $# -eq 0 ]; then
  set -- python3 -m pytest -p no:cacheprovider -m gpu tests/gpu -q --gpu-report gpu-results/report.json
fi
"$@"
