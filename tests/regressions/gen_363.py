"""Minimized reproducer from ember.testing.program_gen, seed 363 (2026-11-22).

Failed: wrong: call 0: arguments after the call[1].state_dict()['running_mean']: values differ: Tensor-likes are not equal! Mismatched elements: 3 / 3 (100.0%) Greatest absolute difference: 0.09424217790365219 at index (1,) Greatest relative difference: 1.0 at index (0,)
"""
import torch


def program(x0, bn):
    v3 = bn(x0)
    return x0


def inputs():
    torch.manual_seed(363)
    calls = []
    calls.append((torch.randn((1, 3, 3), dtype=torch.float32), torch.nn.BatchNorm1d(3), ))
    return calls
