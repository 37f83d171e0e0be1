"""Calling a compiled region's inductor graph directly, without dynamo's per-call work.

A call through `torch.compile` evaluates the frame's guards and unpacks the arguments in Python
(~20 us here), 60 times per step for a 30-layer model; the graph itself is a C++ entry point. So
the regions compile through `capture`, a backend that hands the graph to inductor as usual and
also records where each graph input comes from (the placeholder's dynamo source: an argument,
or an item of one) and which module holds the graph's C++ entry point. After a layer's first
call through dynamo has picked its graph, a `DirectCall` holds that graph's entry point
(`graph_store.NativeGraph`) with the layer's weights already in place and calls it with only
the step's activations.

Which graph dynamo picked is known only when that call compiled it; later layers (and other
models) reuse it through dynamo's cache without a compile. Graphs are therefore looked up by a
`signature` of everything dynamo guards on for these functions: every tensor's dtype, shape,
strides and device, whether tensors are the same object, and every other argument's value. A
`DirectCall` also requires its activations contiguous (the strides the graph was compiled
for); anything else goes through dynamo. Calls run in inference mode, as the engine's steps do.

The same signature keys the `GraphStore` on disk: a region whose graph is stored binds its
layers without tracing at all, so a start with every graph stored imports neither dynamo nor
inductor (`configure` in `compiled.py` sets the store).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.model import quant
from engine.model.graph_store import GraphStore, InputPath, NativeGraph


@dataclass(frozen=True)
class Graph:
    """A compiled graph: its inputs' paths (None if one has no path) and its C++ entry point
    (None if the module holding it was not found: it is then called through `call`)."""

    call: Callable[..., Any]
    paths: list[InputPath] | None
    native: NativeGraph | None


_to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
_captured: list[Graph] = []
_graphs: dict[tuple[Any, ...], Graph] = {}
_store: list[GraphStore | None] = [None]  # set by `use_store`


def use_store(store: GraphStore | None) -> None:
    """Bind layers from (and keep new graphs in) `store`; None: neither."""
    _store[0] = store


def current_store() -> GraphStore | None:
    return _store[0]


def _path(source: Any) -> InputPath | None:
    from torch._dynamo.source import GetItemSource, LocalSource

    items: list[int] = []
    while isinstance(source, GetItemSource) and not source.index_is_slice and isinstance(source.index, int):
        items.append(source.index)
        source = source.base
    if not isinstance(source, LocalSource):
        return None
    return source.local_name, tuple(reversed(items))


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A `torch.compile` backend: inductor's `compile_fx`, the result recorded with its inputs'
    paths and its C++ entry point (from the one wrapper module inductor loaded for it)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx

    before = len(PyCodeCache.modules)
    fn = compile_fx(gm, list(example_inputs))
    assert callable(fn)
    new = [m for m in PyCodeCache.modules[before:] if hasattr(m, "inductor_entry")]
    native = NativeGraph.of_wrapper(new[0]) if len(new) == 1 else None
    paths = [_path(node.meta["grapharg"].source) for node in gm.graph.find_nodes(op="placeholder")]
    _captured.append(Graph(fn, None if None in paths else paths, native))  # type: ignore[arg-type]
    return fn


def signature(values: Sequence[Any]) -> tuple[Any, ...]:
    """What dynamo's guards see of `values` (nested tuples of tensors and constants), and of the
    module globals the regions read: `quant.BF16_EMULATED` picks int8's kernels inside a graph, so
    two graphs traced under its two values (a test forcing the emulated-bf16 path) are two graphs."""
    seen: dict[int, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            alias = seen.setdefault(id(v), len(seen))
            return ("T", v.dtype, tuple(v.shape), v.stride(), v.device, v.requires_grad, alias)
        if isinstance(v, tuple | list):
            return (type(v).__name__, tuple(leaf(x) for x in v))
        return (type(v).__name__, v)

    return (*(leaf(v) for v in values), ("globals", quant.BF16_EMULATED))


class DirectCall:
    """One layer's call of one compiled graph: `call(*activations)` with the weights bound."""

    def __init__(
        self, call: Callable[..., Any] | NativeGraph, paths: list[InputPath], fn: Callable[..., Any],
        args: tuple[Any, ...], dynamic: tuple[int, ...], stored: bool = False,
    ):  # fmt: skip
        self.stored = stored  # bound from the graph store, never traced in this process
        names = list(inspect.signature(fn).parameters)
        bound = dict(zip(names, args, strict=True))
        slot = {names[i]: n for n, i in enumerate(dynamic)}
        self.fn = call
        self.values: list[Any] = []
        self.slots: list[tuple[int, int]] = []  # (position among the graph's inputs, activation index)
        for pos, (name, items) in enumerate(paths):
            if name in slot:
                if items:
                    raise ValueError(f"activation {name} enters the graph by item, not whole")
                self.slots.append((pos, slot[name]))
                self.values.append(None)
                continue
            value = bound[name]
            for i in items:
                value = value[i]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"graph input {name}{list(items)} is not a tensor")
            self.values.append(value)
        self.entry: Callable[[list[Any]], list[Any]] | None = None
        self.call = None if isinstance(call, NativeGraph) else call  # called as is (the AOT path)
        if isinstance(call, NativeGraph):
            if len(paths) + len(call.constants) != call.num_inputs:
                raise ValueError(f"the graph takes {call.num_inputs} inputs, not {len(paths)} + {len(call.constants)}")
            self.values += call.constants  # (what inductor's wrapper appends to each call, appended once)
            self.entry = call.entry

    def __call__(self, *activations: torch.Tensor) -> Any:
        values = self.values.copy()
        for pos, i in self.slots:
            values[pos] = activations[i]
        if self.entry is not None:  # the graph's C++ entry point, tensors passed as handles
            return _from_handles(self.entry(_to_handles(values)))
        assert self.call is not None
        return self.call(*values)


def _same(a: Any, b: Sequence[torch.Tensor]) -> bool:
    a = list(a) if isinstance(a, tuple | list) else [a]
    return len(a) == len(b) and all(
        isinstance(x, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


class Region:
    """A region function compiled through `capture`; `call_and_bind` gives a layer's `DirectCall`."""

    def __init__(self, fn: Callable[..., Any], prepare: Callable[[], None] = lambda: None):
        self.fn = fn
        self._prepare = prepare  # compile settings, applied before the first trace
        self._compiled: Callable[..., Any] | None = None

    @property
    def compiled(self) -> Callable[..., Any]:
        """The function through `torch.compile` (dynamo is imported at the first use)."""
        if self._compiled is None:
            self._prepare()
            self._compiled = torch.compile(self.fn, backend=capture, fullgraph=True, dynamic=False)
        return self._compiled

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    def call_and_bind(self, args: tuple[Any, ...], dynamic: tuple[int, ...]) -> tuple[Any, DirectCall | None]:
        """Call, and return the direct call of the graph that ran for these arguments (None
        when that graph is unknown or its inputs cannot be bound): the stored graph when the
        store has one (no dynamo), else the one dynamo runs, then stored if its direct call
        gives the same outputs."""
        contiguous = all(args[i].is_contiguous() for i in dynamic)
        sig = signature(args)
        store = _store[0]
        if store is not None and contiguous:
            stored = store.load(self.fn, sig)
            if stored is not None:
                try:
                    call = DirectCall(stored[0], stored[1], self.fn, args, dynamic, stored=True)
                except ValueError:
                    pass
                else:
                    return call(*(args[i] for i in dynamic)), call
        key = (self.fn, sig)
        before = len(_captured)
        out = self.compiled(*args)
        if len(_captured) == before + 1:
            _graphs.setdefault(key, _captured[-1])
        graph = _graphs.get(key)
        if graph is None or graph.paths is None or not contiguous:
            return out, None
        try:
            call = DirectCall(graph.call, graph.paths, self.fn, args, dynamic)
            if graph.native is None:
                return out, call
            native = DirectCall(graph.native, graph.paths, self.fn, args, dynamic)
        except ValueError:
            return out, None
        if not _same(out, native(*(args[i] for i in dynamic))):
            return out, call
        if store is not None:
            store.save(self.fn, sig, graph.native, graph.paths)
        return out, native
