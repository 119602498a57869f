"""Minimized reproducer from ember.testing.program_gen, seed 6746 (2026-11-22).

Failed: mismatch: call 0: eager raised RuntimeError: mixed dtype (CPU): all inputs must share same
datatype.; compiled returned. (LayerNorm's float32 parameters on a float64 input: the meta kernel
accepts it, the CPU kernel raises; the result is unused, the op is dropped from the graph, and
the exception is lost.)
"""
import torch


def program(x0, ln):
    v1 = x0 / 4.0
    v2 = v1.to(torch.float64)
    v6 = v2.mean(-2, keepdim=True)
    v10 = ln(v6)
    return v1


def inputs():
    torch.manual_seed(6746)
    calls = []
    calls.append((torch.randn((4, 4), dtype=torch.float32), torch.nn.LayerNorm(4), ))
    return calls
