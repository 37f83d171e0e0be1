"""What `longctx doctor` was asked to do: a frozen options object passed to every stage, and the
command's flags that make it (their defaults are the object's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from api.engine_args import default_device
from engine.loading.model_source import DEMO_MODEL

STAGES = (
    "config",
    "weights",
    "reference",
    "vision",
    "serving",
    "activations",
    "generation",
    "length",
    "parallel",
    "quantization",
)


@dataclass(frozen=True)
class DoctorOptions:
    """Args:
    stages: the stages to run, in `STAGES` order whatever order they were given in.
    dtype: the model's dtype for every stage (the reference runs transformers in the same dtype).
    max_length: the length stage's longest prompt (None = the model's context).
    reference: "transformers" or "none".
    baseline / save_baseline: a baseline file to compare against / to write.
    tensor_parallel_size, expert_parallel, pipeline_parallel_size: the parallel stage's sharding
        (tensor parallel, pipeline stages, and both together when both are given; 1 and 1 = stage
        skipped).
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
    pipeline_parallel_size: int = 1
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
        if self.pipeline_parallel_size < 1:
            raise ValueError("--pipeline-parallel-size must be >= 1")


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    d = DoctorOptions
    p.add_argument("--model", default=DEMO_MODEL, help="directory, .gguf file, pulled name or repo id")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=default_device())
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads (0 = torch's default)")
    p.add_argument("--max-length", type=int, default=d.max_length, help="longest prompt of the length stage")
    p.add_argument("--stages", default=None, help="comma-separated subset, e.g. config,weights,reference")
    p.add_argument("--reference", default=d.reference, choices=["transformers", "none"])
    p.add_argument("--baseline", type=Path, default=d.baseline, help="compare layer by layer with this baseline")
    p.add_argument("--save-baseline", type=Path, default=d.save_baseline, help="write this run's baseline here")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=d.tensor_parallel_size, help="parallel stage: ranks to shard over"
    )
    p.add_argument("--expert-parallel", action="store_true", help="parallel stage: whole experts per rank")
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=d.pipeline_parallel_size,
        help="parallel stage: pipeline stages (alone, and x --tensor-parallel-size)",
    )
    p.add_argument(
        "--serve-dtype",
        default=d.serve_dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="serving stage: the dtype serve runs (its --dtype)",
    )
    p.add_argument("--quantization", default=d.quantization, choices=["none", "int8", "int4"], help="serving stage")
    p.add_argument("--group-size", type=int, default=d.group_size, help="serving stage: int4 group size")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=d.compile,
        help="serving stage: the compiled step (default: as serve picks here)",
    )


def doctor_options(args: argparse.Namespace) -> DoctorOptions:
    """The `DoctorOptions` of the doctor flags (ValueError naming a bad one)."""
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip()) if args.stages else STAGES
    given = vars(args)  # the flags named as the options' fields; --model and --report are the command's
    copied = {f.name: given[f.name] for f in fields(DoctorOptions) if f.name in given and f.name != "stages"}
    return DoctorOptions(stages=stages, **copied)
