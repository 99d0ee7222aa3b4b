"""--regenerate: the answers in the output are the model's own greedy output, turn by turn, also when
a run killed midway is rerun.

The oracle is vLLM run directly through its own chat API (`LLM.chat`), one batched call per
turn, on the same weights in float32.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from datasets import load_from_disk
from transformers import AutoTokenizer

from eagle_extract.data.samples import tokenize_conversation
from eagle_extract.job.regenerate import JOURNAL

from .common import SAMPLE_DATA, engine_temporary
from .conftest import ONE_PROCESS, run_cli

MAX_NEW = 40
ORACLE = r"""
import json, sys
from vllm import LLM, SamplingParams
model, convs = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=513)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]))
chats = [[] for _ in convs]
for turn in range(max(map(len, convs))):
    active = [i for i, c in enumerate(convs) if turn < len(c)]
    for i in active:
        chats[i].append({"role": "user", "content": convs[i][turn]})
    for i, out in zip(active, llm.chat([chats[i] for i in active], params, use_tqdm=False)):
        chats[i].append({"role": "assistant", "content": out.outputs[0].text})
print("ORACLE" + json.dumps(chats))
"""


def vllm_chat_directly(model, user_turns: list[list[str]]) -> list[list[dict]]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", **ONE_PROCESS}
    args = [sys.executable, "-c", ORACLE, str(model), json.dumps(user_turns), str(MAX_NEW)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ORACLE")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("ORACLE") :])


def test_regenerate_questions_and_replace_dataset_answers_skipping_bad_rows(tmp_path, tmp_path_factory, smollm2):
    questions = [json.loads(x) for x in (SAMPLE_DATA / "vicuna_bench_questions.jsonl").open()][:3]
    rows = questions + [
        {"turns": [questions[0]["turns"][0], "Now say it in one sentence."]},  # two turns: the second sees answer 1
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "DATASET"}]},
    ]
    data = tmp_path / "questions.jsonl"
    bad = ['{"turns": ["unterminated', json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n".join(bad) + "\n")
    out = tmp_path / "out"
    args = ["--model", str(smollm2), "--data", str(data), "--output", str(out), "--regenerate"]
    args += ["--max-new-tokens", str(MAX_NEW), "--dtype", "float32", "--seq-length", "512"]

    # killed mid-regeneration: the answers of its finished engine calls (one answer each here) are kept, and
    # the engine's guard removes its temporary files ...
    tmpdir = tmp_path_factory.mktemp("t")  # short enough for vLLM's sockets' folder of the run's own
    killed = subprocess.Popen(
        [sys.executable, "-m", "eagle_extract", *args, "--regenerate-batch-size", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmpdir)},  # vLLM's default layout: engine core and worker processes
    )
    journal = out / JOURNAL
    try:
        deadline = time.time() + 300
        while not (journal.exists() and journal.read_bytes().count(b"\n") >= 2):
            assert time.time() < deadline and killed.poll() is None, "no answers were journaled"
            time.sleep(0.02)
        assert len(engine_temporary(tmpdir)) == 2, engine_temporary(tmpdir)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert not (out / "regenerated.jsonl").exists()
    deadline = time.time() + 30
    while engine_temporary(tmpdir) and time.time() < deadline:  # the guard removes them once the engine is stopped
        time.sleep(0.1)
    assert not engine_temporary(tmpdir)
    kept = journal.read_bytes().count(b"\n")
    # ... and the rerun generates only the rest, several conversations per engine call
    resumed = run_cli(*args, env=ONE_PROCESS)
    assert f"continuing the regeneration after the {kept} answers an interrupted run kept" in resumed.stdout
    assert not journal.exists()

    saved = [json.loads(x) for x in (out / "regenerated.jsonl").open()]
    user_turns = [r["turns"] for r in rows[:4]] + [["Name a colour."]]
    want = vllm_chat_directly(smollm2, user_turns)
    assert [s["row"] for s in saved] == [0, 1, 2, 3, 4]
    assert [s["messages"] for s in saved] == want
    assert all(m["content"] != "DATASET" for s in saved for m in s["messages"])
    assert len([m for m in saved[3]["messages"] if m["role"] == "assistant"]) == 2

    # The extraction is of exactly these conversations.
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ds = load_from_disk(str(out))
    for i, s in enumerate(saved):
        ids, mask = tokenize_conversation(tokenizer, s["messages"])
        assert ds[i]["input_ids"].tolist() == ids and ds[i]["loss_mask"].tolist() == mask
    manifest = json.loads((out / "eagle_extract.json").read_text())
    assert manifest["num_samples"] == 5 and manifest["regenerated"]["answers"] == 6
    assert manifest["regenerated"]["kept_answers"] == kept
    report = [json.loads(x) for x in (out / "skipped_rows.jsonl").open()]
    assert [(r["row"], r["reason"].split(" (")[0]) for r in report] == [
        (5, "malformed JSON line"),
        (6, "unknown role 'wizard'"),
    ]
    assert manifest["skipped"] == 2


def test_kept_answers_replay_every_turn_and_a_torn_last_line_is_dropped(tmp_path, smollm2):
    """What a rerun does with an interrupted run's journal, every answer kept (so no engine call is made):
    later turns see the kept answers, a turn that no longer fits --seq-length still ends its conversation,
    and a line a power cut tore is dropped and cut off, so the next append starts a whole line."""
    from eagle_extract.config import ExtractConfig
    from eagle_extract.data.formats import Record
    from eagle_extract.job.regenerate import Journal, regenerate

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    model = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    records = [
        Record(0, messages=[user("One?"), model("DATASET"), user("Two?")]),
        Record(3, messages=[user("Short?"), user("word " * 300)]),  # its second turn cannot fit 128 tokens
    ]
    journal = Journal(tmp_path / JOURNAL)
    journal.append([
        {"row": 0, "turn": 0, "text": "first", "finish": "stop"},
        {"row": 0, "turn": 1, "text": "second", "finish": "length"},
        {"row": 3, "turn": 0, "text": "short", "finish": "stop"},
    ])  # fmt: skip
    with open(journal.path, "a") as f:
        f.write('{"row": 3, "turn": 1, "te')  # torn
    kept = journal.read()
    assert kept == {0: {0: ("first", "stop"), 1: ("second", "length")}, 3: {0: ("short", "stop")}}
    assert journal.path.read_text().endswith('"finish": "stop"}\n')
    cfg = ExtractConfig(seq_length=128, max_new_tokens=16)
    result, stats = regenerate(None, tokenizer, records, cfg, kept)
    assert result[0].messages == [user("One?"), model("first"), user("Two?"), model("second")]
    assert result[1].messages == [user("Short?"), model("short")]
    assert (stats.kept_answers, stats.answers, stats.hit_max_new_tokens, stats.cut_at_seq_length) == (3, 3, 1, 1)
