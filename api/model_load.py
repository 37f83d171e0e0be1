"""`longctx serve`'s model, loading on a thread of its own from the moment the command starts.

Loading (mapping the weights, packing them for oneDNN) mostly runs in torch's C++ code without
the GIL, so it overlaps the imports of the HTTP stack (Litestar, xgrammar, transformers) and the
Redis phase instead of following them. The `model` startup phase then only waits for it. The
tokenizer waits for `imported()`: transformers' lazy module cannot be imported from two threads
at once (a model directory's whole load waits: its config is read through transformers). This
module imports nothing heavy itself.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from typing import Any


class ModelLoad:
    """`engine.loading.loader.load` for the serve flags, started at once on a daemon thread."""

    def __init__(self, args: argparse.Namespace, gguf: bool = True):
        self.args = args
        self.gguf = gguf
        self.started_at = time.perf_counter()
        self._done = threading.Event()
        self._imported = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="longctx-model", daemon=True).start()

    @classmethod
    def start(cls, args: argparse.Namespace) -> ModelLoad | None:
        """Started only when `serve` will get as far as loading (its early checks would pass);
        otherwise None, and the checks report the problem."""
        from engine.loading.model_source import resolve_model

        if args.tensor_parallel_size > 1 or args.expert_parallel:
            return None
        if args.redis_url is None and shutil.which("redis-server") is None:
            return None
        try:
            source = resolve_model(args.model)
        except Exception:
            return None
        return cls(args, source.kind == "gguf")

    def imported(self) -> None:
        """The command's thread has done its imports (transformers among them)."""
        self._imported.set()

    def _run(self) -> None:
        try:
            if not self.gguf:
                self._imported.wait()
            self._result = load_model(self.args, self._imported.wait)
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._done.set()

    def finish(self, timeout_s: float = 120) -> None:
        """Let a load still running end before the process exits (an early exit, or a signal during
        loading): interpreter shutdown under a thread inside torch's kernels can crash."""
        self._imported.set()
        self._done.wait(timeout_s)

    def wait(self) -> Any:
        """The `LoadedModel` (blocks until loaded); raises what loading raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


def load_model(args: argparse.Namespace, before_tokenizer: Any = None) -> Any:
    from engine.loading.loader import load

    if args.threads:  # loading (dequantizing, packing) runs on torch's threads too
        import torch

        torch.set_num_threads(args.threads)
    from engine.loading.overrides import parse_overrides

    return load(
        args.model, args.dtype, args.device, progress=False, quantization=args.quantization,
        group_size=args.group_size, before_tokenizer=before_tokenizer,
        hf_overrides=parse_overrides(getattr(args, "hf_overrides", None)),
        chat_template=getattr(args, "chat_template", None),
    )  # fmt: skip
