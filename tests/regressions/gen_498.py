"""Minimized reproducer from ember.testing.program_gen, seed 498 (2026-11-22).

Failed: wrong: call 0: arguments after the call[1].state_dict()['running_mean']: values differ: Tensor-likes are not equal! Mismatched elements: 4 / 4 (100.0%) Greatest absolute difference: 0.11263375729322433 at index (3,) Greatest relative difference: 1.0 at index (0,)
"""
import torch


def program(x1, bn):
    v4 = bn(x1)
    return None


def inputs():
    torch.manual_seed(498)
    calls = []
    calls.append((torch.randn((4, 4), dtype=torch.float32), torch.nn.BatchNorm1d(4), ))
    return calls
