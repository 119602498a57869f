"""ember: a just-in-time compiler for PyTorch programs with a C11 core.

    import ember

    @ember.compile
    def f(x, y):
        return torch.cos(torch.cos(x)) * y

The public API mirrors torch.compile's (torch/__init__.py, torch/_dynamo/eval_frame.py):
compile, reset, disable, config, plus cache_info and explain to look inside.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
import warnings

import torch

# The CPython versions whose bytecode and frames ember's C core reads (csrc/core/em_core.h); pip
# refuses the others at install time (pyproject.toml, requires-python).
SUPPORTED_PYTHON = ((3, 11), (3, 13))
if not SUPPORTED_PYTHON[0] <= sys.version_info[:2] <= SUPPORTED_PYTHON[1]:
    raise ImportError(f"ember supports CPython 3.11, 3.12 and 3.13; this is Python {sys.version.split()[0]}")

from ._config import config
from . import _C
from . import _backends, _logs
from ._backends import list_backends, register_backend, resolve as _resolve_backend
from ._dynamic import mark_dynamic, mark_static, maybe_mark_dynamic
from ._explain import BreakReason, ExplainOutput, explain
from ._logs import set_logs
from ._pin import pin, pinned, unpin

GraphBreakError = _C.GraphBreakError
FALLBACK_REASONS: dict[str, str] = _C._break_reasons()

# torch releases the test suite passed with: 2.13 (CI, CPU), 2.14.1 (the whole suite, CPU), 2.11
# (the GPU machine, CPU and CUDA tensors); 2.12 lies between them
TESTED_TORCH = ((2, 11), (2, 14))


def _untested_torch(version: str):
    """The warning for a torch outside TESTED_TORCH (None inside it). version: torch.__version__."""
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    lo, hi = TESTED_TORCH
    if lo <= (major, minor) <= hi:
        return None
    return (f"ember is tested with torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; torch {version} may differ where ember "
            f"reads torch's internals (kernel choices, meta functions): a graph ember cannot compile falls back "
            f"to eager with its reason recorded")


if _untested_torch(torch.__version__):
    warnings.warn(_untested_torch(torch.__version__), RuntimeWarning, stacklevel=2)

__all__ = [
    "compile", "reset", "disable", "config", "cache_info", "explain", "list_backends",
    "register_backend", "GraphBreakError", "FALLBACK_REASONS", "mark_dynamic", "mark_static", "maybe_mark_dynamic",
    "ExplainOutput", "BreakReason", "set_logs", "pin", "unpin", "pinned",
]

_module_classes: dict[type, type] = {}


MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(fn_or_module=None, *, backend="ember", fullgraph=False, dynamic=None, mode=None, options=None):
    """Compiles a function, bound method or nn.Module; returns an object called like the original.

    Each call binds its arguments, checks the guards of the cache entries of the function's code
    and runs the matching compiled graph; a miss traces the bytecode again (a recompile). What the
    tracer cannot capture runs as ordinary Python, with the reason in ember.cache_info(fn).

    Args:
      fn_or_module: a Python function, a bound method, or a torch.nn.Module. Omitted: returns a
        decorator (``@ember.compile(backend=...)``).
      backend: "ember" (the default: ember's own code generator: lowering, fusion, C + OpenMP
        kernels on the CPU, CUDA C kernels on a GPU, training through ember's AOT autograd;
        docs/backend_cpu.md, docs/backend_cuda.md, docs/autograd.md. A graph it cannot compile, or
        a machine without a C compiler / NVRTC, runs on the eager backend with a RuntimeWarning and
        the reason in ember.cache_info(fn)[i]["ember"]["fallback"]), "eager" (the graph replayed op
        by op from C: eager's own kernels, bitwise eager's results), "aot_eager", "inductor" (torch's
        Inductor, for comparison), "fx", or a callable ``(gm: torch.fx.GraphModule, example_inputs:
        list) -> callable`` (torch.compile's custom-backend contract).
      fullgraph: raise ember.GraphBreakError (naming the reason and the source line) instead of
        falling back when a frame cannot be captured whole.
      dynamic: as torch.compile's. None (default): static first; a recompile caused by a changed
        size makes that dim symbolic ("automatic dynamic"), and one caused by a changed value of a
        Python int argument makes that int a symbolic int (a graph input). True: every dim of every
        tensor input and every int argument symbolic from the first call. False: never (marks from
        ember.mark_dynamic also ignored). Sizes 0 and 1 are always specialised (ints are not, as
        torch's); docs/dynamic_shapes.md. Backend "ember" compiles a symbolic graph once for all
        sizes (sizes are kernel arguments: one C compiler call serves every size the entry's guards
        admit), training graphs included: backends "ember" and "aot_eager" derive one joint graph
        and partition for all sizes (docs/autograd.md, "Symbolic sizes") where every derivative
        rule the graph needs serves symbolic sizes. Where one does not, under None a size change
        traces the graph again with concrete sizes (one compiled region per size, up to
        config.cache_size_limit; cache_info(fn)[i]["dynamic"] says why), and under True the
        region keeps eager autograd (cache_info(fn)[i]["autograd"]["fallback"] says why).
      mode: torch.compile's modes. None / "default" and "max-autotune-no-cudagraphs": launch the
        compiled graph on every call (ember has no measured kernel search yet, so the latter is the
        default's behaviour). "reduce-overhead" and "max-autotune": CUDA graphs
        (docs/backend_cuda.md, "CUDA graphs"): each graph entry on CUDA tensors is recorded once
        in a CUDA graph (in a memory pool of torch's caching allocator private to this compiled
        function) and replayed: the inputs are copied into static buffers, the graph replayed and
        its outputs cloned (a later replay never changes a returned tensor). A graph whose rows
        along dim 0 are independent (proved over the IR) is recorded at the bucket of its batch
        size, the next power of two (inputs padded, outputs sliced), so batch sizes 5..8 share one
        recording; other graphs record one per shape. Entries that cannot be replayed safely (CPU
        tensors, inputs that require grad, several devices, symbolic sizes, a capture error) launch
        as usual, with the reason in ember.cache_info(fn)[i]["cudagraphs"] (also: "captures", the
        function's recordings). With a CUDA graph mode and dynamic=None, automatic dynamic leaves
        dim 0 static (one entry per batch size; the buckets share recordings) and makes other dims
        that change symbolic, launched without CUDA graphs: a KV cache that grows each decode step
        is one entry, not a compile per step.
      options: accepted for compatibility; must be None or empty.

    Returns: for a function, an ember._C.CompiledFunction; for a bound method, the same bound to
    its object; for a module, a module of a subclass of the original class that shares the
    original's __dict__ (parameters, buffers, submodules, hooks, state_dict keys) and whose call
    is compiled.

    Raises: TypeError for anything that is not a Python function, method or module; ValueError
    for an unknown backend name or mode.
    """
    if mode not in MODES:
        raise ValueError(f"ember: unknown mode {mode!r}; known: {', '.join(map(repr, MODES))}")
    if fn_or_module is None:
        return functools.partial(compile, backend=backend, fullgraph=fullgraph, dynamic=dynamic, mode=mode,
                                 options=options)
    if dynamic is not None:
        dynamic = bool(dynamic)
    if options:
        raise ValueError(f"ember: unknown options {sorted(options)}")
    cudagraphs = None
    if mode in ("reduce-overhead", "max-autotune"):
        from ._cudagraphs import Pool
        cudagraphs = Pool()
    backend, key = _resolve_backend(backend)
    if cudagraphs is not None:
        key = (key, cudagraphs)  # entries of this compiled function only: they hold its pool's recordings
    if isinstance(fn_or_module, torch.nn.Module):
        return _compile_module(fn_or_module, backend, key, fullgraph, dynamic, cudagraphs)
    if isinstance(fn_or_module, _C.CompiledFunction):
        fn_or_module = fn_or_module.__wrapped_function__
    if isinstance(fn_or_module, types.MethodType) and isinstance(fn_or_module.__func__, types.FunctionType):
        cf = _C.CompiledFunction(fn_or_module.__func__, backend, key, bool(fullgraph), self=fn_or_module.__self__,
                                 dynamic=dynamic, cudagraphs=cudagraphs)
        return functools.update_wrapper(cf, fn_or_module.__func__)
    if isinstance(fn_or_module, types.FunctionType):
        if inspect.isgeneratorfunction(fn_or_module) or inspect.iscoroutinefunction(fn_or_module):
            raise TypeError(f"ember.compile: generators and coroutines are not supported: {fn_or_module!r}")
        return functools.update_wrapper(_C.CompiledFunction(fn_or_module, backend, key, bool(fullgraph), dynamic=dynamic,
                                                            cudagraphs=cudagraphs), fn_or_module)
    raise TypeError(f"ember.compile expects a function, a bound method or an nn.Module, got {type(fn_or_module).__name__}")


def _compile_module(mod: torch.nn.Module, backend, key, fullgraph, dynamic=None, cudagraphs=None):
    """A module sharing mod's __dict__ whose class's __call__ is the compiled forward (or the
    compiled __call__, when the class overrides nn.Module.__call__)."""
    cls = type(mod)
    inner_code = None
    if _is_ddp(mod):
        # DistributedDataParallel's forward (its reducer's bookkeeping, the ddp-active flag) runs as
        # Python, as under torch.compile; the module it wraps is compiled when its forward starts,
        # inside that flag, so its training graphs split at DDP's buckets (ember.config.optimize_ddp)
        icls = type(mod.module)
        ifn = icls.forward if icls.__call__ is torch.nn.Module.__call__ else icls.__call__
        if not isinstance(ifn, types.FunctionType):
            raise TypeError(f"ember.compile: {icls.__name__}.forward (inside DistributedDataParallel) is not a Python function")
        inner_code = ifn.__code__
        _C._hook_compile_code(inner_code)
        cf = _C.CompiledFunction(cls.forward, backend, key, bool(fullgraph), self=mod, module=mod, dynamic=dynamic,
                                 cudagraphs=cudagraphs, python_frame=True)
    elif cls.__call__ is torch.nn.Module.__call__:
        forward = cls.forward
        if not isinstance(forward, types.FunctionType):
            raise TypeError(f"ember.compile: {cls.__name__}.forward is not a Python function")
        # a module with hooks runs Module.__call__, and the hook compiles forward's frame: also a
        # forward in torch's directory (nn.Sequential), which the skip rules leave alone otherwise
        _C._hook_compile_code(forward.__code__)
        cf = _C.CompiledFunction(forward, backend, key, bool(fullgraph), self=mod, module=mod, dynamic=dynamic,
                                 cudagraphs=cudagraphs)
    else:
        call = cls.__call__
        if not isinstance(call, types.FunctionType):
            raise TypeError(f"ember.compile: {cls.__name__}.__call__ is not a Python function")
        cf = _C.CompiledFunction(call, backend, key, bool(fullgraph), self=mod, module=mod, dynamic=dynamic,
                                 cudagraphs=cudagraphs)
    # one subclass per compiled module: the compiled call lives on the class (slot_tp_call finds
    # it there), so instances need no extra state and share the original's __dict__
    sub = type(f"Compiled{cls.__name__}", (cls,), {
        "__call__": cf,
        "__module__": cls.__module__,
        "__qualname__": f"Compiled{cls.__qualname__}",
        "_orig_mod": mod,
        "_ember_compiled": cf,
        "_ember_code": inner_code,
    })
    wrapper = object.__new__(sub)
    object.__setattr__(wrapper, "__dict__", mod.__dict__)
    return wrapper


def _is_ddp(mod) -> bool:
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    return ddp is not None and isinstance(mod, ddp.DistributedDataParallel)


def reset() -> None:
    """Drops every cache entry of every code object (torch._dynamo.reset's counterpart).

    The on-disk kernel cache and the meta-call memo (ember.config.meta_memo: metadata of torch
    calls, no code) are kept, as torch._dynamo.reset keeps Inductor's caches and FakeTensorMode's.
    """
    _C._reset()


class _Disable(contextlib.ContextDecorator):
    def __enter__(self):
        _C._disable_enter()
        return self

    def __exit__(self, *exc):
        _C._disable_exit()
        return False


def disable(fn=None):
    """Runs code without ember: ``@ember.disable`` on a function, or ``with ember.disable():``.

    Inside, compiled objects call their original Python code, and the frame hook compiles
    nothing (torch._dynamo.disable's behaviour).
    """
    if fn is None:
        return _Disable()
    return _Disable()(fn)


def _code_of(fn):
    if isinstance(fn, _C.CompiledFunction):
        return fn.__code__
    if isinstance(fn, torch.nn.Module):
        cf = getattr(type(fn), "_ember_compiled", None)
        if getattr(type(fn), "_ember_code", None) is not None:  # DDP: the wrapped module's forward
            return type(fn)._ember_code
        return cf.__code__ if cf is not None else type(fn).forward.__code__
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        return fn.__code__
    if isinstance(fn, types.CodeType):
        return fn
    raise TypeError(f"ember.cache_info: no code object in {fn!r}")


def cache_info(fn, resume=False) -> list[dict]:
    """The cache entries of fn's code, most recently used first.

    fn: a compiled object, a plain function, bound method, module or code object (the frame hook
    also compiles functions called from code that falls back). Each entry is a dict:
      kind: "graph", "break" (a graph, then the breaking instruction in Python and a resume
      function: the frame was split at a graph break) or "fallback"; backend; guards: list of str
      (one line of Python each); graph: the captured graph as a table (None for fallbacks, and
      for a break whose graph is empty); output: how the return value (or, for a break, the
      values live at the break) is built; reason / reason_text / detail / filename / lineno /
      opname: why the frame broke or fell back; hits: calls answered by this entry; resume (break
      entries): the resume functions' code objects; code: the qualified name of the code.
    resume: also list the entries of the resume functions, recursively (after fn's own).
    """
    code = _code_of(fn)
    out = []
    seen = set()
    todo = [code]
    while todo:
        c = todo.pop(0)
        if id(c) in seen:
            continue
        seen.add(id(c))
        for e in _C._cache_info(c):
            e["code"] = c.co_qualname
            out.append(e)
            if resume:
                todo.extend(e.get("resume", ()))
        if not resume:
            break
    return out


_logs.init_from_env()

from . import debug  # noqa: E402  (ember.debug.dump; EMBER_DUMP=dir starts a dump at import)

debug._from_env()
