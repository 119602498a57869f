"""Helpers that the dumped files of ember.debug.dump call: the guard functions that have no plain
Python spelling (their C versions live in csrc/guard), loading a dumped graph, and binding the
resume functions. Dumped files run in two ways: inside ember (the C core picks the cache entry
and calls the file's __transformed_code_* function) or on their own (runpy.run_path(path), then
the file's dispatcher function, which checks the guards in Python)."""
from __future__ import annotations

import importlib
import os
import sys

import torch

from .. import _C


class NoCacheEntry(RuntimeError):
    """No cache entry of the dumped frame matches: ember would compile a new one here."""


def user_globals(ns: dict, module: str) -> dict:
    """The user's module globals (G): the ones ember passed in, else the module's by import."""
    g = ns.get("__ember_globals__")
    if g is not None:
        return g
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except Exception:
            return ns
    return vars(mod)


def module(name: str):
    """A module a guard names (its types and objects are spelled module.qualname)."""
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


def load_graph(ns: dict, name: str):
    """__compiled_fn_N: the function ember registered for this dump, else the dumped file run
    on its own (its fx-style forward, eager semantics)."""
    graphs = ns.get("__ember_graphs__") or {}
    if name in graphs:
        return graphs[name]
    path = os.path.join(os.path.dirname(ns["__file__"]), name + ".py")
    gns = {"__name__": name, "__file__": path}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), gns)
    return gns[name]


def original(ns: dict, g: dict, name: str, qualname: str):
    """A fallback entry's function: the original code (a resume function's, inside ember; the
    user's function, found by its qualified name in its module, on its own)."""
    real = (ns.get("__ember_resume__") or {}).get(name)
    if real is not None:
        return real
    obj = g
    try:
        for part in qualname.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    except (KeyError, AttributeError):
        raise NotImplementedError(f"ember runs the original code of {qualname} here; it is not reachable from this file")
    return getattr(obj, "__wrapped__", obj)


class graph_region:
    """Runs a graph as the C core does: with ember's frame hook and compiled calls off."""

    def __enter__(self):
        _C._disable_enter()

    def __exit__(self, *exc):
        _C._disable_exit()
        return False


def bind_resume(ns: dict) -> None:
    """Inside ember the resume functions are the real ones (the frame hook compiles them and runs
    their dumped transformed code); on its own the file keeps its Python dispatchers."""
    ns.update(ns.get("__ember_resume__") or {})


# ---- guard helpers (csrc/guard/em_guard_render.c names them) ----

def ___dict_version(d):
    """Dict version tags are not visible from Python: the content check after "or" decides."""
    return None


def ___dict_entries_unchanged(d, keys):
    """Whether each key still holds what the trace saw (or is still absent) is checked by ember's
    C guard, which keeps the objects; the rendered text names only the keys, so this passes."""
    return isinstance(d, dict)


___dict_items_unchanged = ___dict_entries_unchanged


class _Unknown:
    """A type version tag: not visible from Python; compares equal (ember checks it in C)."""

    def __eq__(self, other):
        return True


def ___type_version(tp):
    return _Unknown()


def ___id(x):
    return id(x)


def ___global_state(grad, autocast_cpu, autocast_cuda, default_dtype):
    try:
        cpu = torch.is_autocast_enabled("cpu")
        cuda = torch.is_autocast_enabled("cuda")
    except TypeError:  # older torch
        cpu, cuda = torch.is_autocast_cpu_enabled(), torch.is_autocast_enabled()
    return (torch.is_grad_enabled() == grad and cpu == autocast_cpu and cuda == autocast_cuda
            and torch.get_default_dtype() == default_dtype)


def ___sdp_flags(flash, mem_efficient, math, cudnn, math_fp16_bf16_reduction):
    """The scaled_dot_product_attention backends enabled (sdpa_kernel contexts) and whether the math
    kernel may compute half / bfloat16 in their own dtype, as recorded."""
    b = torch.backends.cuda
    return (b.flash_sdp_enabled() == flash and b.mem_efficient_sdp_enabled() == mem_efficient
            and b.math_sdp_enabled() == math and b.cudnn_sdp_enabled() == cudnn
            and b.fp16_bf16_reduction_math_sdp_allowed() == math_fp16_bf16_reduction)


def check_tensor(x, dtype, device=None, size=None, stride=None, requires_grad=None, type=None, **_):
    """Dynamo's TENSOR_MATCH: type, dtype, device, sizes, strides, requires_grad."""
    if not isinstance(x, torch.Tensor) or x.dtype != dtype:
        return False
    if type is not None and x.__class__ is not type:
        return False
    if device is not None and str(x.device) != str(device):
        return False
    if size is not None and (len(size) != x.dim() or any(
            isinstance(s, int) and s != n for s, n in zip(size, x.shape))):  # symbolic sizes: not checked here
        return False
    if stride is not None and all(isinstance(s, int) for s in stride) and list(x.stride()) != list(stride):
        return False
    return requires_grad is None or x.requires_grad == requires_grad


GUARD_HELPERS = {n: globals()[n] for n in (
    "___dict_version", "___dict_entries_unchanged", "___dict_items_unchanged", "___type_version", "___id",
    "___global_state", "___sdp_flags", "check_tensor")}
