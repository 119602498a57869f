"""The matrix-multiply calls of one nn.TransformerEncoder forward (bench/models.py's, fast path
off) under ember and under torch.compile(inductor), side by side in one process: for each aten
mm / addmm / bmm call, its argument shapes, strides and 64-byte alignment and its time (ms, one
call, measured around the dispatch; a TorchDispatchMode adds Python work between calls, so the
absolute times are not the compiled forward's). Used to check whether ember hands torch's GEMMs
other layouts than Inductor does (bench/README.md, dev VM transformer).

    .venv/bin/python bench/matmul_calls.py [--rows 8]
"""
import argparse
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import ember  # noqa: E402


class MatmulLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not any(k in name for k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")):
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        ms = (time.perf_counter() - t0) * 1e3
        layout = [(tuple(a.shape), a.stride(), a.data_ptr() % 64) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((name, layout, out.stride(), ms))
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8, help="calls printed per compiler")
    a = ap.parse_args()
    torch.manual_seed(0)
    m = models.transformer_encoder()
    x = torch.randn(8, 128, 256)
    torch.backends.mha.set_fastpath_enabled(False)
    with torch.no_grad():
        compiled = {"ember": ember.compile(m), "inductor": torch.compile(m)}
        for f in compiled.values():
            for _ in range(3):
                f(x)
        for name, f in compiled.items():
            log = MatmulLog()
            with log:
                f(x)
            print(f"{name}: {len(log.calls)} matmul calls, {sum(c[3] for c in log.calls):.1f} ms in total")
            for c in log.calls[:a.rows]:
                print(f"  {c[0]:<22} args (shape, stride, ptr % 64) {c[1]}  out stride {c[2]}  {c[3]:.2f} ms")


if __name__ == "__main__":
    main()
