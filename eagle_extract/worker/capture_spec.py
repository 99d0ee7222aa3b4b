"""The driver–worker boundary: what every worker is asked to capture, settled once on the driver.

`collective_rpc` carries it as a plain dict (vLLM's engine-core channel serialises plain data only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .hostmem import default_budget


@dataclass(frozen=True)
class CaptureSpec:
    output: str  # where the writing ranks write rows (a pipeline stage: its part files, under it)
    aux_ids: tuple[int, ...]
    host_bytes: int  # captured states one writing rank may hold in host memory
    decoder_path: str | None = None
    fp8: bool = False
    legacy: bool = False
    writer_threads: int | None = None
    durable: bool = True  # fsync every file (not the server's spool's, whose files live seconds)
    rows_fail_alone: bool = False  # a row whose file cannot be written fails alone (the server's requests)

    def as_rpc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_rpc(cls, fields: dict) -> CaptureSpec:
        return cls(**{**fields, "aux_ids": tuple(fields["aux_ids"])})


def host_bytes_per_rank(host_memory_gib: float | None, ranks: int) -> int:
    """--host-memory (GiB; default hostmem.default_budget()) in bytes, shared by the job's `ranks` writing
    ranks on this machine: its --dp replicas times its --pp stages."""
    total = int(host_memory_gib * 2**30) if host_memory_gib else default_budget()
    return total // ranks
