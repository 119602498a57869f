"""ResNet-18 inference in both memory formats, side by side in one process: eager, ember.compile and
torch.compile (Inductor), each on the model as built (NCHW, contiguous input) and after
model.to(memory_format=torch.channels_last) with a channels_last input. Inductor converts
convolution inputs to channels_last itself on CPU (GraphLowering.decide_layout_opt); ember keeps
the user's layout (docs/backend_cpu.md, "channels_last"). Median of interleaved rounds under
torch.no_grad(); every result is checked against eager (rtol/atol 1e-3). Timings are not asserted.

usage: python bench/resnet_layouts.py [--rounds 7] [--batch 16] [--no-inductor]
"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import ember  # noqa: E402
from models import resnet18  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rn, src = resnet18()
    x = torch.randn(args.batch, 3, 128, 128)
    rcl, xcl = copy.deepcopy(rn).to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    cases = {"eager": (rn, x), "eager_cl": (rcl, xcl), "ember": (ember.compile(copy.deepcopy(rn)), x),
             "ember_cl": (ember.compile(copy.deepcopy(rcl)), xcl)}
    if not args.no_inductor:
        cases["inductor"] = (torch.compile(copy.deepcopy(rn)), x)
        cases["inductor_cl"] = (torch.compile(copy.deepcopy(rcl)), xcl)
    with torch.no_grad():
        ref = rn(x)
        for f, a in cases.values():  # compile, check, warm
            torch.testing.assert_close(f(a), ref, rtol=1e-3, atol=1e-3)
            f(a)
        times = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, (f, a) in cases.items():
                t = time.perf_counter()
                f(a)
                times[k].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"ResNet-18 inference ({src}), batch {args.batch}, 3x128x128, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} interleaved rounds")
    for k, m in med.items():
        print(f"  {k:<12} {m * 1e3:8.2f} ms  {med['eager'] / m:5.2f}x eager")


if __name__ == "__main__":
    main()
