"""The worker extension vLLM mixes into every TP/PP worker (`worker_extension_cls`).

The driver reaches these methods by name through `LLM.collective_rpc`, so no code is
serialised and vLLM's insecure-serialisation switch stays off.  Every method returns
small plain data; tensors never cross the RPC boundary, they go straight to disk.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..files.writer import BackgroundWriter
from .capture import StepCapture
from .capture_spec import CaptureSpec
from .hostmem import ByteBudget
from .model_nav import DecoderNotFound, find_decoder
from .stages import part_root, stage_slots

EXTENSION_CLASS = "eagle_extract.worker.extension.HiddenStateExtension"


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class HiddenStateExtension:
    """Per-worker capture state lives in `self._eagle` (vLLM never calls an extension's __init__)."""

    def eagle_install(self, spec: dict) -> dict:
        """Hook the decoder on the one rank per TP group that writes; other ranks stay hook-free.

        `spec` is a capture_spec.CaptureSpec as a dict.  A pipeline stage hooks only its own layers and,
        unless it runs them all, writes its slots as part files (stages.py) that the driver joins, in the
        requested format, into each row's file.  With `fp8` a whole model's states are quantised on its
        device; part files are joined, then quantised, on the host.  Every file records its slots' layer
        ids, taken from `aux_ids` and the layer count of the model loaded here, for `verify` to hold the
        manifest to."""
        spec = CaptureSpec.from_rpc(spec)
        aux_ids, output = list(spec.aux_ids), spec.output
        model = self.get_model()
        try:
            stack = find_decoder(model, spec.decoder_path)
        except DecoderNotFound as exc:  # the user's to fix: said by the driver, not as the engine's failure
            return {"decoder_not_found": str(exc), "writes": False}
        slots = stage_slots(aux_ids, stack.num_layers, stack.start, stack.end)
        whole = stack.is_first_stage and stack.is_last_stage
        info = {
            "path": stack.path,
            "num_layers": stack.num_layers,
            "start": stack.start,
            "end": stack.end,
            "slots": slots,
            "part": None if whole else str(part_root(output, stack.start, stack.end)),
            "tp_rank": _tp_rank(),
            "model_class": type(model).__name__,
            "dtype": str(self.model_config.dtype).removeprefix("torch."),  # the engine's, whatever --dtype said
        }
        writes = info["tp_rank"] == 0 and bool(slots)
        if writes:
            folder = output if whole else info["part"]
            layer_ids = [(aux_ids + [stack.num_layers])[k] for k in slots]  # recorded in every file it writes
            writer = BackgroundWriter(
                folder,
                fp8=spec.fp8 and whole,
                legacy=spec.legacy and whole,
                threads=spec.writer_threads,
                layer_ids=layer_ids,
                durable=spec.durable,
                rows_fail_alone=spec.rows_fail_alone,
            )
            budget = ByteBudget(spec.host_bytes)
            capture = StepCapture(stack, aux_ids, writer.submit, budget, fp8=spec.fp8 and whole, ids_from=model)
            capture.install()
            self._eagle = (capture, writer)
        return {**info, "writes": writes}

    def eagle_heartbeat(self, path: str, every_s: float) -> None:
        """Touch `path` at the start of a forward pass, at most every `every_s` seconds: the driver's
        engine watch then sees steps, not only finished engine calls (watch.py)."""
        last = [0.0]

        def touch(module, args, kwargs):
            now = time.monotonic()
            if now - last[0] >= every_s:
                last[0] = now
                try:
                    Path(path).touch()
                except OSError:  # the watch then goes by the driver's progress alone
                    pass

        self.get_model().register_forward_pre_hook(touch, with_kwargs=True)

    def eagle_expect(self, rows: list[tuple[int, list[int]]], loss_masks: list | None = None) -> None:
        """Announce the rows of the next generate call: (dataset row index, prompt token ids), and
        for the legacy format, whose files carry it, each row's loss mask."""
        if getattr(self, "_eagle", None):
            capture, writer = self._eagle
            if loss_masks and writer.legacy:
                writer.expect_loss_masks(loss_masks)
            capture.expect(rows)

    def eagle_drain(
        self, wait: bool = True, finished: list[int] | None = None, patience: float = 0.0, expect: list | None = None
    ) -> dict | None:
        """Report rows written, errors and capture stats; `wait` until capture and disk have caught up.
        Every row announced so far has run (a generate call returned, or the engine ran empty); with
        `finished`, only these rows have, while others still run (the server's continuous batching).
        Without `wait`, `patience` waits up to that long for a row to be written, when none was yet.
        `expect` then announces the next rows, as `eagle_expect` would: the server's loop makes one RPC
        a step, since each waits for the engine core's step in progress.  `worker_s`: this call's own
        seconds here, the part of a look the engine core spends waiting for this worker."""
        t0 = time.perf_counter()
        if not getattr(self, "_eagle", None):
            return None
        capture, writer = self._eagle
        if finished is None:
            capture.settle()
        else:
            capture.retire(finished)
        captured = (
            capture.drain() if wait else {"stats": capture.counts(), "pending": [], "errors": list(capture.errors)}
        )
        report = writer.drain(wait, patience)
        report["errors"] = captured["errors"] + report["errors"]
        redo, lost = capture.take_unwritten()
        untrusted = capture.untrusted
        if expect:
            capture.expect(expect)
        worker_s = time.perf_counter() - t0
        return {**captured, **report, "redo": redo, "lost": lost, "untrusted": untrusted, "worker_s": worker_s}

    def eagle_remove(self) -> None:
        if getattr(self, "_eagle", None):
            capture, writer = self._eagle
            capture.remove()
            writer.close()
            self._eagle = None
