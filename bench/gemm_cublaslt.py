"""ember's GEMM externs through cuBLASLt from C (ember._C.Gemm, csrc/runtime/em_runtime_gemm.c) against
torch's functions, on the GPU machine: (1) host and device time of one call at GPT-2's shapes, torch's
function and the Gemm side by side; (2) full-size models compiled by ember with
ember.config.cublaslt_gemm on and off, in alternating blocks (ember.reset() and a fresh compile per
block: ember's cache entries of a model's copies are shared, so the two cannot run interleaved), ms
per call or AdamW step (median), the host's share (time until the call returns) and the programs'
Gemm calls (cache_info(fn)[i]["ember"]["gemm"]). TF32 off, as bench/fullsize.py.

    python3 bench/gemm_cublaslt.py                        # both parts
    python3 bench/gemm_cublaslt.py --rows gpt2:train --no-micro
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fullsize  # noqa: E402

import ember  # noqa: E402


def per_call(fn, n=300):
    """(host us, wall us, device us) per call of fn: n calls timed until the last returns, until the
    GPU is done, and by CUDA events over another n."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6, e0.elapsed_time(e1) / n * 1e3


def micro():
    torch.manual_seed(0)
    print("| dtype | call | torch host us | Gemm host us | torch wall us | Gemm wall us | device us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(4096, 768, device="cuda", dtype=dt)
        xs = x[:8].clone()
        w = torch.randn(768, 2304, device="cuda", dtype=dt)
        W = w.t().contiguous()
        b = torch.randn(2304, device="cuda", dtype=dt)
        cases = [("addmm (4096x768) @ (768x2304) + bias", torch.addmm, (b, x, w)),
                 ("addmm, 8 rows", torch.addmm, (b, xs, w)),
                 ("mm x^T x (a weight gradient)", torch.mm, (x.t(), x)),
                 ("F.linear (4096x768), (2304x768), bias", F.linear, (x, W, b))]
        with torch.no_grad():
            for name, target, args in cases:
                g = ember._C._gemm(target)
                th, tw, td = per_call(lambda: target(*args))
                gh, gw, _ = per_call(lambda: g(*args))
                print(f"| {str(dt)[6:]} | {name} | {th:.2f} | {gh:.2f} | {tw:.2f} | {gw:.2f} | {td:.2f} |")
    print(ember._C._gemm_stats())


def gemm_calls(c):
    n = 0
    for e in ember.cache_info(c):
        ag = (e.get("autograd") or {}).get("ember", {})
        for part in [e.get("ember") or {}, ag.get("forward") or {}, ag.get("backward") or {}]:
            n += len((part.get("gemm") or {}).get("calls", []))
    return n


def models(rows, dtype_name, rounds, calls):
    dtype = fullsize.DTYPES[dtype_name]
    print(f"| row | Gemm ms | host ms | torch's functions ms | host ms | speed-up | Gemm calls per call |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        name, mode = row.split(":")
        base, x = fullsize.build(name, "full", mode)
        base = base.to(dtype).cuda()
        base.train(mode != "infer")
        if mode != "infer" and hasattr(base, "config"):
            base.eval()
        x = x.cuda()
        if x.is_floating_point():
            x = x.to(dtype)
        wall = {True: [], False: []}
        host = {True: [], False: []}
        ncalls = {}
        for _ in range(rounds):
            for on in (True, False):
                ember.reset()
                ember.config.cublaslt_gemm = on
                m = copy.deepcopy(base)
                c = ember.compile(m)
                step = fullsize.make_step(m, c, x, mode, dtype, "cuda")
                for _ in range(4):
                    step()
                torch.cuda.synchronize()
                ncalls[on] = gemm_calls(c)
                for _ in range(calls):
                    t = time.perf_counter()
                    step()
                    h = time.perf_counter()
                    torch.cuda.synchronize()
                    wall[on].append((time.perf_counter() - t) * 1e3)
                    host[on].append((h - t) * 1e3)
                del m, c, step
        ember.config.cublaslt_gemm = True
        med = statistics.median
        print(f"| {name} {dtype_name} {mode} | {med(wall[True]):.2f} | {med(host[True]):.2f} | {med(wall[False]):.2f} | "
              f"{med(host[False]):.2f} | {med(wall[False]) / med(wall[True]):.3f} | {ncalls[True]} (off: {ncalls[False]}) |",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="gpt2:infer,llama:infer,gpt2:train,llama:train")
    ap.add_argument("--dtype", default="bf16", choices=sorted(fullsize.DTYPES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--no-micro", dest="micro", action="store_false")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemm_cublaslt.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.micro:
        micro()
    if args.rows:
        models(args.rows.split(","), args.dtype, args.rounds, args.calls)


if __name__ == "__main__":
    main()
