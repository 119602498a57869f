"""Backends: what turns a captured graph into something callable (DESIGN.md decision 6).

"eager" never reaches this file: the C core replays the graph op by op (ember._C.EagerGraph).
Every other backend gets a torch.fx.GraphModule built from ember's IR and the example inputs,
the contract of torch.compile's custom backends: backend(gm, example_inputs) -> callable that
takes the graph inputs positionally and returns a tuple (or list) of the graph outputs.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import _fx

_REGISTRY: dict[str, Callable] = {}


def register_backend(name: str, fn: Callable | None = None):
    """Registers fn(gm, example_inputs) -> callable under name; usable as a decorator."""
    def add(f):
        _REGISTRY[name] = f
        return f
    return add(fn) if fn is not None else add


def list_backends() -> list[str]:
    """Names accepted by ember.compile(backend=...): "eager", "ember" and the registered ones."""
    return ["eager", "ember", *sorted(_REGISTRY)]


@register_backend("inductor")
def _inductor(gm: torch.fx.GraphModule, example_inputs):
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs)


@register_backend("fx")
def _fx_forward(gm: torch.fx.GraphModule, example_inputs):
    """The fx GraphModule itself, run by torch.fx's generated Python (for debugging)."""
    return gm.forward


def resolve(backend):
    """Checks a backend argument; returns (backend, key). Raises ValueError for unknown names."""
    if backend in ("eager", "ember"):
        return backend, backend
    if isinstance(backend, str):
        if backend not in _REGISTRY:
            raise ValueError(f"ember: unknown backend {backend!r}; known: {', '.join(list_backends())}")
        return backend, backend
    if not callable(backend):
        raise TypeError(f"ember: backend must be a name or a callable (gm, example_inputs) -> callable, got {backend!r}")
    return backend, backend


def compile_graph(backend, export, example_inputs, name):
    """Called by the C core on a cache miss: builds the fx graph and hands it to the backend."""
    gm = _fx.to_graph_module(export, name=f"ember_{name}")
    fn = _REGISTRY[backend] if isinstance(backend, str) else backend
    compiled = fn(gm, list(example_inputs))
    if not callable(compiled):
        raise TypeError(f"ember: backend {backend!r} returned {compiled!r}, which is not callable")
    return compiled
