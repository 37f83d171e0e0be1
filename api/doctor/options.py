"""What `longctx doctor` was asked to do: a frozen options object passed to every stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAGES = (
    "config", "weights", "reference", "vision", "serving", "activations", "generation", "length", "parallel",
    "quantization",
)  # fmt: skip


@dataclass(frozen=True)
class DoctorOptions:
    """Args:
    stages: the stages to run, in `STAGES` order whatever order they were given in.
    dtype: the model's dtype for every stage (the reference runs transformers in the same dtype).
    max_length: the length stage's longest prompt (None = the model's context).
    reference: "transformers" or "none".
    baseline / save_baseline: a baseline file to compare against / to write.
    tensor_parallel_size, expert_parallel: the parallel stage's sharding (1 = stage skipped).
    serve_dtype, quantization, group_size, compile: the serving stage's configuration, as
        `longctx serve` takes them (`compile` None: what serve picks here).
    """

    stages: tuple[str, ...] = STAGES
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0
    max_length: int | None = None
    reference: str = "transformers"
    baseline: Path | None = None
    save_baseline: Path | None = None
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    greedy_tokens: int = 32
    serve_dtype: str = "auto"
    quantization: str = "none"
    group_size: int = 32
    compile: bool | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"--stages: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
        object.__setattr__(self, "stages", tuple(s for s in STAGES if s in self.stages))
        if self.reference not in ("transformers", "none"):
            raise ValueError(f"--reference must be transformers or none, got {self.reference!r}")
        if self.max_length is not None and self.max_length < 16:
            raise ValueError(f"--max-length must be at least 16, got {self.max_length}")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
