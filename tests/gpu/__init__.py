"""GPU correctness tests: eagle-extract on CUDA against transformers, against vLLM's own extraction, and
against itself across TP, PP, DP and executors.  Run on a GPU machine, e.g. inside scripts/gpu_run.sh:

    python3 -m pytest -m gpu tests/gpu -q --gpu-report gpu-results/report.json

Without a CUDA device every test here skips (tests/gpu/conftest.py).
"""
