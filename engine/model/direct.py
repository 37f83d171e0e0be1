"""Calling a compiled region's inductor graph directly, without dynamo's per-call work.

A call through `torch.compile` evaluates the frame's guards and unpacks the arguments in Python
(~20 us here), 60 times per step for a 30-layer model; the graph itself is a C++ entry point. So
the regions compile through `capture`, a backend that hands the graph to inductor as usual and
also records where each graph input comes from (the placeholder's dynamo source: an argument,
or an item of one). After a layer's first call through dynamo has picked its graph, a
`DirectCall` holds that graph with the layer's weights already in place and calls it with only
the step's activations.

Which graph dynamo picked is known only when that call compiled it; later layers (and other
models) reuse it through dynamo's cache without a compile. Graphs are therefore looked up by a
`signature` of everything dynamo guards on for these functions: every tensor's dtype, shape,
strides and device, whether tensors are the same object, and every other argument's value. A
`DirectCall` also requires its activations contiguous (the strides the graph was compiled
for); anything else goes through dynamo. Calls run in inference mode, as the engine's steps do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.source import GetItemSource, LocalSource

# Graph inputs: per graph input, a path from the function's arguments (name, then item indices).
InputPath = tuple[str, tuple[int, ...]]
Graph = tuple[Callable[..., Any], list[InputPath] | None]

_captured: list[Graph] = []
_graphs: dict[tuple[Any, ...], Graph] = {}


def _path(source: Any) -> InputPath | None:
    items: list[int] = []
    while isinstance(source, GetItemSource) and not source.index_is_slice and isinstance(source.index, int):
        items.append(source.index)
        source = source.base
    if not isinstance(source, LocalSource):
        return None
    return source.local_name, tuple(reversed(items))


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A `torch.compile` backend: inductor's `compile_fx`, the result recorded with its inputs' paths."""
    from torch._inductor.compile_fx import compile_fx

    fn = compile_fx(gm, list(example_inputs))
    assert callable(fn)
    paths = [_path(node.meta["grapharg"].source) for node in gm.graph.find_nodes(op="placeholder")]
    _captured.append((fn, None if None in paths else paths))  # type: ignore[arg-type]
    return fn


def signature(values: Sequence[Any]) -> tuple[Any, ...]:
    """What dynamo's guards see of `values` (nested tuples of tensors and constants)."""
    seen: dict[int, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            alias = seen.setdefault(id(v), len(seen))
            return ("T", v.dtype, tuple(v.shape), v.stride(), v.device, v.requires_grad, alias)
        if isinstance(v, tuple | list):
            return (type(v).__name__, tuple(leaf(x) for x in v))
        return (type(v).__name__, v)

    return tuple(leaf(v) for v in values)


class DirectCall:
    """One layer's call of one compiled graph: `call(*activations)` with the weights bound."""

    def __init__(self, graph: Graph, fn: Callable[..., Any], args: tuple[Any, ...], dynamic: tuple[int, ...]):
        call, paths = graph
        assert paths is not None
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
            self.values.append(value)

    def __call__(self, *activations: torch.Tensor) -> Any:
        values = self.values.copy()
        for pos, i in self.slots:
            values[pos] = activations[i]
        return self.fn(*values)


class Region:
    """A region function compiled through `capture`; `direct` gives a layer's `DirectCall`."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.compiled = torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    def call_and_bind(self, args: tuple[Any, ...], dynamic: tuple[int, ...]) -> tuple[Any, DirectCall | None]:
        """Call through dynamo, and return the direct call of the graph it ran for these
        arguments (None when that graph is unknown or its inputs cannot be bound)."""
        key = (self.fn, signature(args))
        before = len(_captured)
        out = self.compiled(*args)
        if len(_captured) == before + 1:
            _graphs.setdefault(key, _captured[-1])
        graph = _graphs.get(key)
        if graph is None or graph[1] is None or not all(args[i].is_contiguous() for i in dynamic):
            return out, None
        try:
            return out, DirectCall(graph, self.fn, args, dynamic)
        except ValueError:
            return out, None
