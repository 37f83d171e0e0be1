"""Runs the doctor's stages in order, times each, and prints each table as it finishes.

`run_doctor(spec, options)` is the command: config, then the load (with the weights stage's
statistics streamed from the loader), then the stages that need the loaded model.
`run_stages(loaded, options)` runs those on a model already loaded in this process, so that a
test can damage the model in memory (a permuted or transposed tensor, another RoPE) and check
what the doctor says.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from api.doctor.context import DoctorContext
from api.doctor.length_stage import peak_rss_bytes
from api.doctor.options import DoctorOptions
from api.doctor.report import Report, StageResult, print_stage
from engine.loading.loader import LoadedModel


def _progress(text: str) -> None:
    print(f"doctor: {text}", file=sys.stderr, flush=True)


def _timed(report: Report, name: str, fn: Callable[[StageResult], None], echo: bool) -> StageResult:
    st = StageResult(name)
    _progress(f"stage {name} ...")
    t0 = time.perf_counter()
    try:
        fn(st)
    except Exception as e:  # a stage that crashes fails, with the error; the others still run
        st.fail(f"{type(e).__name__}: {e}")
    st.seconds = time.perf_counter() - t0
    report.stages.append(st)
    _progress(f"stage {name}: {st.status} in {st.seconds:.1f} s")
    if echo:
        print_stage(st)
    return st


def _reference(ctx: DoctorContext, st: StageResult) -> None:
    from api.doctor.baseline import compare_baseline, save_baseline
    from api.doctor.reference_stage import reference_stage

    reference_stage(ctx, st)
    if ctx.options.baseline is not None:
        compare_baseline(ctx, ctx.options.baseline, st)
    if ctx.options.save_baseline is not None:
        save_baseline(ctx, ctx.options.save_baseline)
        st.note(f"baseline saved to {ctx.options.save_baseline}")


def run_stages(
    loaded: LoadedModel,
    options: DoctorOptions,
    report: Report | None = None,
    *,
    reference_model: Any = None,
    served: LoadedModel | None = None,
    echo: bool = False,
) -> Report:
    """The stages after loading, on `loaded` as it is in memory.

    Args:
        reference_model: a transformers model of the same checkpoint to compare with (else the
            reference stage loads one).
        served: the serving stage's model (else it loads the configuration the options name).
        echo: print each stage's table to stdout as it finishes.
    """
    from api.doctor.activations_stage import activations_stage
    from api.doctor.generation_stage import generation_stage
    from api.doctor.length_stage import length_stage
    from api.doctor.parallel_stage import parallel_stage
    from api.doctor.quantization_stage import quantization_stage
    from api.doctor.serving_stage import serving_stage
    from api.doctor.vision_stage import vision_stage

    report = report or Report(loaded.source.name)
    ctx = DoctorContext(loaded, options, reference_model, served)
    stages: dict[str, Callable[[DoctorContext, StageResult], None]] = {
        "reference": _reference,
        "vision": vision_stage,
        "serving": serving_stage,
        "activations": activations_stage,
        "generation": generation_stage,
        "length": length_stage,
        "parallel": parallel_stage,
        "quantization": quantization_stage,
    }
    for name, fn in stages.items():
        if name in options.stages:
            _timed(report, name, lambda st, fn=fn: fn(ctx, st), echo)  # type: ignore[misc]
    return report


def run_doctor(spec: str, options: DoctorOptions, *, echo: bool = True) -> Report:
    """The whole doctor on `--model spec`: config, load (with weight statistics), then the rest."""
    from api.doctor.config_stage import config_stage, ignored_fields
    from api.doctor.weights_stage import TensorStatsCollector, weights_stage
    from engine.loading.loader import load, open_source
    from engine.loading.model_source import resolve_model

    if options.threads:
        torch.set_num_threads(options.threads)
    report = Report(spec)
    source = resolve_model(spec)
    report.model = source.name

    def config(st: StageResult) -> None:
        model_config, reader_keys, prefix = _open_config(source)
        config_stage(source, model_config, st, ignored_fields(source, reader_keys, prefix))

    if "config" in options.stages:
        if _timed(report, "config", config, echo).status == "fail":
            return report
    else:
        open_source(source)  # an unsupported checkpoint fails here, before anything is loaded
    collector = TensorStatsCollector()
    loaded: list[LoadedModel] = []
    check = "weights" in options.stages

    def weights(st: StageResult) -> None:
        loaded.append(load(spec, options.dtype, options.device, on_tensor=collector if check else None))
        if check:
            weights_stage(collector.stats, loaded[0].stats, peak_rss_bytes(), st)
        else:
            st.note(loaded[0].stats.summary())

    _timed(report, "weights" if check else "load", weights, echo)
    if not loaded:
        return report
    return run_stages(loaded[0], options, report, echo=echo)


def _open_config(source: Any) -> tuple[Any, set[str] | None, str]:
    """The model config, with the GGUF metadata keys read to build it (to name the ignored ones)."""
    if source.kind != "gguf":
        from engine.model.config import ModelConfig

        return ModelConfig.from_pretrained_dir(source.path), None, ""
    from engine.loading.gguf_file import GGUFSource

    read: set[str] = set()

    class Recording(GGUFSource):
        def _value(self, key: str, *args: Any) -> Any:
            read.add(key)
            return super()._value(key, *args)

    gguf = Recording(source.path)
    return gguf.config, read, gguf.arch + "."
