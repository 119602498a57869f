"""The kernels of a full-size model under ember on CUDA, by device time, with the header of each of
its slowest generated kernels (the nodes it fuses, its domain, its launch): what to look at when a
row of bench/fullsize.py is slow (issue 40).

    python bench/kernel_report.py gpt2,vit          # bf16 inference, the models of bench/fullsize.py
    python bench/kernel_report.py resnet50 --dtype fp32 --top 40

Per model: every kernel's device time per call (torch.profiler over 5 calls after 3 warm-up calls)
and launches per call, then for the slowest ember kernels the comment block the CUDA code generator
writes above each (ember.set_logs("output_code")). Needs a GPU; times are never asserted.
"""
import argparse
import io
import logging
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import ember

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import fullsize  # noqa: E402  (bench/fullsize.py: the models)


def report(name, dtype, top, headers):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("ember").addHandler(handler)
    ember.set_logs("output_code")
    try:
        ember.reset()
        model, x = fullsize.build(name, "full", "infer")
        model = model.cuda().to(dtype).eval()
        x = x.cuda().to(dtype) if x.is_floating_point() else x.cuda()
        compiled = ember.compile(model)
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    compiled(x)
                torch.cuda.synchronize()
    finally:
        ember.set_logs("")
        logging.getLogger("ember").removeHandler(handler)
    rows = sorted(((e.device_time_total / 5, e.count // 5, e.key) for e in prof.key_averages() if e.device_time_total > 0),
                  reverse=True)
    print(f"######## {name} {dtype}: {sum(r[0] for r in rows):.0f} us of kernels per call, {sum(r[1] for r in rows)} launches")
    for t, n, k in rows[:top]:
        print(f"{t:9.1f} us {n:4d}x  {k[:120]}")
    src = buf.getvalue()
    for t, n, k in [r for r in rows if r[2].startswith("ember_k")][:headers]:
        i = src.find(f"/* kernel {k[len('ember_k'):]} (")
        if i >= 0:
            print(f"== {k} {t:.1f} us: " + " ".join(ln.strip() for ln in src[i:src.find('*/', i)].splitlines()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", help="comma-separated: gpt2, bert, llama, resnet50, vit")
    ap.add_argument("--dtype", default="bf16", choices=sorted(fullsize.DTYPES))
    ap.add_argument("--top", type=int, default=25, help="kernels listed per model")
    ap.add_argument("--headers", type=int, default=12, help="ember kernels whose header is printed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_report.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in args.models.split(","):
        report(name, fullsize.DTYPES[args.dtype], args.top, args.headers)


if __name__ == "__main__":
    main()
