"""Skinny GEMMs: F.linear of a few rows (a decode step's projections), cuBLAS against ember's GEMV kernel.

For each dtype, rows (batch x 1 token) and weight shape of a Llama-style decoder's decode step
(d 1024: q/o 1024 x 1024, k/v 256 x 1024, gate/up 2816 x 1024, down 1024 x 2816, LM head 32000 x
1024): the device time of one call of eager's F.linear (cuBLAS) and of ember._C.skinny_linear (the
kernel the skinny_mm pass writes), from torch.profiler's kernel times over 48 calls, each call on
another copy of the weight (copies beyond the L2 cache: a decode step reads every weight once from
DRAM), and the weight's bytes over that time. The largest difference from float64 products is
printed as a check.

    python bench/skinny_gemm.py                       # CUDA only
    python bench/skinny_gemm.py --dtypes bf16 --rows 4
"""
import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import ember  # noqa: F401  (ember._C)
from ember import _C

SHAPES = [(1024, 1024), (256, 1024), (2816, 1024), (1024, 2816), (32000, 1024)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_us(fn, x, ws, calls=48):
    """Mean device time per call (us) of fn(x, w) over calls, w rotating over ws."""
    for w in ws:
        fn(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for i in range(calls):
            fn(x, ws[i % len(ws)])
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in p.key_averages() if e.self_device_time_total > 0) / calls


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--rows", default="1,2,4,8")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; device us per call, weight GB/s")
    print("| dtype | rows | N x K | cuBLAS us | ember us | cuBLAS GB/s | ember GB/s | ember / cuBLAS speed | max err |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for dn in args.dtypes.split(","):
        dt = DTYPES[dn]
        for rows in map(int, args.rows.split(",")):
            for N, K in SHAPES:
                nbytes = N * K * torch.finfo(dt).bits // 8
                copies = max(2, min(24, (192 << 20) // nbytes))  # > the H200's 60 MB of L2
                ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(copies)]
                x = torch.randn(rows, 1, K, device="cuda", dtype=dt)
                want = (x.double().view(rows, K) @ ws[0].double().t()).view(rows, 1, N)
                err = (_C.skinny_linear(x, ws[0]).double() - want).abs().max().item()
                tc, te = device_us(F.linear, x, ws), device_us(_C.skinny_linear, x, ws)
                print(f"| {dn} | {rows} | {N} x {K} | {tc:.2f} | {te:.2f} | {nbytes / tc / 1e3:.0f} | {nbytes / te / 1e3:.0f} "
                      f"| {tc / te:.2f} | {err:.1e} |", flush=True)
                del ws


if __name__ == "__main__":
    main()
