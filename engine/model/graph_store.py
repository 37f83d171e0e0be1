"""Compiled region graphs kept on disk, called without dynamo, AOTAutograd or inductor.

With `cpp_wrapper`, each graph inductor builds is a Python extension module holding one C++
entry point, `inductor_entry_cpp(input handles) -> output handles`. A `NativeGraph` holds it
for `direct.DirectCall` to call directly (the tensors converted to handles and back in C++),
skipping the Python layers that wrap it (dynamo's disable wrapper, AOTAutograd's runtime
wrapper, `CompiledFxGraph.__call__`).

A `GraphStore` copies such a module to `<root>/<key>.so`, with `<key>.json` saying which
argument of the region feeds each graph input. The key digests what decides the graph: the
region function, the source of the model package (`engine/model/*.py` and `*.cpp`, where the
regions and the linears they call live), the signature of the call's arguments (what dynamo guards on:
dtypes, shapes, strides, aliasing, constants), the versions of torch and Python, the CPU's
instruction sets, the C++ compiler, and which of our linear kernels the tracing process had
loaded (`cpu_kernel.traced_ops`: without them a region traces torch's own ops, e.g.
`_weight_int8pack_mm` for int8, so such a graph is never bound where the kernels are). A later
start with the same key loads the file: no trace, no import of inductor, no FX-cache lookup.
Only a graph whose direct call gave exactly the outputs of the call through dynamo is stored
(`Region.call_and_bind`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.attention import cpu_kernel

log = logging.getLogger("longctx.compile")

ENTRY = "inductor_entry_cpp"  # the entry point's name in every module inductor's cpp_wrapper builds
# Per graph input, where it comes from: an argument's name, then item indices into it.
InputPath = tuple[str, tuple[int, ...]]
_INPUTS = re.compile(r"steal_from_raw_handles_to_raii_handles\(input_handles, (\d+)\)")
_CONSTANTS = re.compile(r"constants_tensor = \[([^\]]*)\]")


class NativeGraph:
    """A compiled graph's C++ entry point: `entry(input handles) -> output handles`.

    The entry point takes `num_inputs` tensors: the graph's inputs, then its `constants`
    (tensors inductor made while compiling, e.g. the int4 group size as a 0-d tensor), which
    inductor's Python wrapper appends to every call and `direct.DirectCall` likewise."""

    def __init__(
        self, entry: Callable[[list[Any]], list[Any]], path: Path, constants: list[torch.Tensor], num_inputs: int
    ):
        self.entry = entry
        self.path = path  # the extension module's file
        self.constants = constants
        self.num_inputs = num_inputs

    @classmethod
    def of_wrapper(cls, wrapper: Any) -> NativeGraph | None:
        """The graph of inductor's Python wrapper module for a cpp_wrapper graph, or None when
        the module is not of the expected form (its input count or constants not found)."""
        entry = getattr(wrapper, "inductor_entry", None)
        source, file = getattr(wrapper, "cpp_wrapper_src", None), getattr(wrapper, "__file__", None)
        so = getattr(getattr(entry, "__self__", None), "__file__", None)
        if entry is None or not isinstance(source, str) or file is None or so is None:
            return None
        inputs = _INPUTS.search(source)
        if inputs is None:
            return None
        constants = _CONSTANTS.search(Path(file).read_text())
        names = [n.strip() for n in constants.group(1).split(",") if n.strip()] if constants else []
        values = [getattr(wrapper, n, None) for n in names]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if len(tensors) != len(values):
            return None
        return cls(entry, Path(so), tensors, int(inputs.group(1)))

    @classmethod
    def load(cls, path: Path, name: str, constants: list[torch.Tensor], num_inputs: int) -> NativeGraph:
        # The module's init reads this address (a function in torch's own library) from the environment.
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
            torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr  # type: ignore[attr-defined]
        )
        module_name = f"{name}.{ENTRY}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the compiled graph {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[module_name] = module
        return cls(getattr(module, ENTRY), path, constants, num_inputs)


@functools.cache
def _source_digest() -> str:
    """The model package's source: the regions, and every linear, norm and RoPE they call, and
    the linear kernels' C++ (a graph calls their ops by schema: a changed op is a new graph)."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for path in sorted([*here.glob("*.py"), *here.glob("*.cpp")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class GraphStore:
    """Graphs on disk under `root`, by a key of the region function and its call's signature."""

    def __init__(self, root: Path):
        self.root = root

    def __str__(self) -> str:
        return str(self.root)

    def key(self, fn: Callable[..., Any], signature: Sequence[Any]) -> str:
        digest = hashlib.sha256()
        cxx = cpu_kernel.compiler() or ""
        parts = (
            f"{fn.__module__}.{fn.__qualname__}",
            _source_digest(),
            repr(tuple(signature)),
            torch.__version__,
            sys.version,
            cpu_kernel.cpu_flags(),
            cpu_kernel.compiler_version(cxx) if cxx else "",
            cpu_kernel.traced_ops(),
        )
        for part in parts:
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()[:32]

    def _files(self, key: str) -> tuple[Path, Path, Path]:
        """A graph's metadata, library and constants."""
        return self.root / f"{key}.json", self.root / f"{key}.so", self.root / f"{key}.pt"

    def has(self, fn: Callable[..., Any], signature: Sequence[Any]) -> bool:
        meta, so, _ = self._files(self.key(fn, signature))
        return meta.exists() and so.exists()

    def load(self, fn: Callable[..., Any], signature: Sequence[Any]) -> tuple[NativeGraph, list[InputPath]] | None:
        """The stored graph and its inputs' paths, or None when there is none (or it does not load)."""
        key = self.key(fn, signature)
        meta, so, consts = self._files(key)
        if not (meta.exists() and so.exists()):
            return None
        try:
            info = json.loads(meta.read_text())
            paths = [(name, tuple(items)) for name, items in info["inputs"]]
            constants = torch.load(consts, weights_only=True) if info["constants"] else []
            graph = NativeGraph.load(so, f"longctx_graph_{key}", constants, info["num_inputs"])
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
            log.warning("stored graph %s does not load (%s); compiling it again", so, e)
            return None
        return graph, paths

    def save(
        self, fn: Callable[..., Any], signature: Sequence[Any], graph: NativeGraph, paths: list[InputPath]
    ) -> None:
        """Keep `graph` (a copy of its module file) and its inputs' paths; atomic per file."""
        key = self.key(fn, signature)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                so, meta, consts = (Path(tmp) / f"graph{ext}" for ext in (".so", ".json", ".pt"))
                shutil.copyfile(graph.path, so)
                torch.save(graph.constants, consts)
                info = {"function": f"{fn.__module__}.{fn.__qualname__}", "inputs": paths}
                meta.write_text(json.dumps(info | {"constants": len(graph.constants), "num_inputs": graph.num_inputs}))
                final_meta, final_so, final_consts = self._files(key)
                # the metadata last: a reader that finds it finds the rest
                so.replace(final_so)
                consts.replace(final_consts)
                meta.replace(final_meta)
        except OSError as e:
            log.warning("could not store the compiled graph under %s: %s", self.root, e)
