"""Setting up `torch.compile` for the compiled step: whether inductor's CPU backend can build here,
where its caches and the graph store live, and the options set once before the first trace."""

from __future__ import annotations

import functools
import os
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from engine.attention import cpu_kernel
from engine.model.direct import use_store
from engine.model.graph_store import GraphStore

# Compiled graphs per region's code object across all models of a process (a model uses at
# most len(BUCKETS) per region; tests and benchmarks build several models).
RECOMPILE_LIMIT = 64


@functools.cache
def compile_available() -> str | None:
    """None when inductor's CPU backend can build here; else why not (no C++ compiler, no headers)."""
    cxx = cpu_kernel.compiler()
    if cxx is None:
        return "no C++ compiler (g++) on PATH"
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.exists():
        return f"no Python headers ({include} is missing; install python3-dev)"
    try:
        subprocess.run([cxx, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the C++ compiler {cxx} does not run: {e}"
    return None


def configure(home: Path, graphs: Path | None = None) -> Path:
    """Point inductor's caches at `home/compile` (`$LONGCTX_HOME/compile` in the engine) and the
    graph store at `graphs` (default `home/compile/graphs`); call before the first compile.
    Dynamo and inductor themselves are set up (and imported) only when a graph is traced:
    a start whose graphs are all stored never imports them. Returns the cache directory."""
    cache = home / "compile"
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    use_store(GraphStore(graphs or cache / "graphs"))
    return cache


@functools.cache
def prepare() -> None:
    """The compile options, set once before the first trace (this imports dynamo and inductor)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.cpp_wrapper = True  # C++ wrapper: no Python between the kernels of a region
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True
    _packed_linear_as_fallback()
    _cpp_keys_without_the_environment()


@functools.cache
def _cpp_keys_without_the_environment() -> None:
    """Let inductor find a graph's C++ build again from any virtual environment.

    inductor keys each C++ build (a graph's wrapper and kernels: `cpp_wrapper`) by its source and
    its compile command, and the command names torch's headers and libraries by their absolute
    paths inside the environment torch is installed in. Every new environment (a fresh clone's
    `.venv`, a reinstall) thus built every graph's C++ again, torch unchanged: 79 builds, minutes of
    a core, in a `make test` of a new clone whose caches were otherwise warm. So the key is taken
    with torch's directory written as its version; the build itself still runs the real command
    (the files it makes link to the libraries by name, which the process has already loaded)."""
    import torch
    import torch._inductor.codecache as codecache
    from torch.utils import cpp_extension

    root, named = cpp_extension._TORCH_PATH, f"<torch {torch.__version__}>"
    write = codecache.write

    def keyed_without_root(content: str | bytes, extension: str, extra: str = "", *args: Any, **kwargs: Any) -> Any:
        if extension.endswith(".cpp") and kwargs.get("key") is None and not args:
            kwargs["key"] = codecache.get_hash(content.strip(), extra.replace(root, named), "code")
        return write(content, extension, extra, *args, **kwargs)

    codecache.write = keyed_without_root  # `CppCodeCache.load_async` looks it up at each build


@functools.cache
def _packed_linear_as_fallback() -> None:
    """Let inductor call `mkldnn._linear_pointwise` (our prepacked bf16 linears) as the aten op.

    Its inductor lowering, and the oneDNN fusion patterns that rewrite a linear + add or a
    linear + activation into it, exist for freezing, where the packed weight is a constant of
    the graph, and assert so; here the weight is an input (one graph for all layers). So the
    patterns are left unregistered (they are registered once per process, at the first
    compile, only while oneDNN is enabled) and the op runs as an extern call through the
    dispatcher, as in the eager model."""
    import torch._inductor.mkldnn_lowerings  # (registers the lowering to replace)
    from torch._inductor.fx_passes.post_grad import lazy_init
    from torch._inductor.lowering import lowerings, make_fallback

    with torch.backends.mkldnn.flags(enabled=False):
        lazy_init()
    op = torch.ops.mkldnn._linear_pointwise.default
    lowerings.pop(op, None)
    make_fallback(op, warn=False)
