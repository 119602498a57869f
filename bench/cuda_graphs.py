"""mode="reduce-overhead" (CUDA graphs): per-call time of eager, torch.compile and ember, side by side
in one process, and CUDA graph recordings for a model called with 10 batch sizes (issue 13's target).

Programs: Mod(100) and Mod(1) of bench/overhead.py (n modules each adding its Python int) on 8
float32 on the GPU; an MLP (64 -> 256 -> 256 -> 10, ReLU) at batch 1 under torch.no_grad().
Compilers: eager; torch.compile(mode="reduce-overhead") (Inductor + cudagraph trees);
ember.compile(backend="ember", mode="reduce-overhead") and ember.compile(backend="eager",
mode="reduce-overhead"). Per-call time = wall time of N back-to-back calls / N, synchronised at the
end (so CPU overhead and GPU time both count; at these sizes the CPU side dominates), best of
several rounds that interleave the compilers. Each result is checked against eager.
Recordings: the MLP called with batch sizes 1..10 (each twice); ember's count from
ember.cache_info(m)[0]["cudagraphs"]["pool"]["captures"], torch's from its cudagraph tree
manager's graph counter. Timings are never asserted by tests.

Also printed: the time of one clone of the output (what ember's output semantics add per call).

usage: python bench/cuda_graphs.py [--rounds N] [--calls N] [--json PATH]
"""
import argparse
import json
import os
import re
import sys
import time

import torch

import ember

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Mod  # noqa: E402  (the anchor's Mod(n): n modules each adding its int)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 256)
        self.l2 = torch.nn.Linear(256, 256)
        self.l3 = torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def per_call(fn, x, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def torch_graphs():
    """Graphs recorded so far by torch's cudagraph trees on device 0."""
    try:
        from torch._inductor.cudagraph_trees import get_container
        mgr = get_container(0).tree_manager
        if mgr is None:
            return 0
        return int(re.search(r"count\((\d+)", repr(mgr.graph_counter)).group(1))
    except Exception:  # noqa: BLE001
        return -1


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    progs = {
        "mod100": (Mod(100).to(dev), torch.randn(8, device=dev)),
        "mod1": (Mod(1).to(dev), torch.randn(8, device=dev)),
        "mlp_b1": (MLP().to(dev), torch.randn(1, 64, device=dev)),
    }
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "programs": {}}
    with torch.no_grad():
        for name, (m, x) in progs.items():
            comps = {
                "eager": m,
                "torch.compile": torch.compile(m, mode="reduce-overhead"),
                "ember": ember.compile(m, backend="ember", mode="reduce-overhead"),
                "ember eager": ember.compile(m, backend="eager", mode="reduce-overhead"),
            }
            want = m(x)
            ok = {}
            for k, f in comps.items():
                for _ in range(5):  # compile, record, warm
                    out = f(x)
                ok[k] = bool(torch.allclose(out, want, rtol=1e-4, atol=1e-5))
            best = {k: float("inf") for k in comps}
            for _ in range(a.rounds):
                for k, f in comps.items():
                    best[k] = min(best[k], per_call(f, x, a.calls))
            # what cloning the outputs adds to ember's call (docs/backend_cuda.md, "CUDA graphs")
            clone = min(per_call(torch.Tensor.clone, want, a.calls) for _ in range(a.rounds))
            cg = ember.cache_info(comps["ember"])[0].get("cudagraphs", {})
            res["programs"][name] = {"us": {k: v * 1e6 for k, v in best.items()}, "match": ok, "output_clone_us": clone * 1e6,
                                     "ember_state": cg.get("state"), "ember_reason": cg.get("reason")}
            r = res["programs"][name]
            print(f"{name:8s} per call us: " + "  ".join(f"{k}={v:.2f}" for k, v in r["us"].items())
                  + f" | ember/torch.compile={r['us']['ember'] / r['us']['torch.compile']:.2f}"
                  + f" ember/eager={r['us']['ember'] / r['us']['eager']:.2f}"
                  + f" | output clone {clone * 1e6:.2f} | match {ok} | ember cudagraphs: {r['ember_state']} {r['ember_reason'] or ''}", flush=True)
        # recordings over 10 batch sizes
        old = ember.config.cache_size_limit
        ember.config.cache_size_limit = 64
        torch._dynamo.reset()
        m = MLP().to(dev)
        tm = torch.compile(m, mode="reduce-overhead")
        em = ember.compile(m, backend="ember", mode="reduce-overhead")
        t0 = torch_graphs()
        bad = 0
        for b in list(range(1, 11)) * 2:
            x = torch.randn(b, 64, device=dev)
            want = m(x)
            bad += not torch.allclose(tm(x), want, rtol=1e-4, atol=1e-5)
            bad += not torch.allclose(em(x), want, rtol=1e-4, atol=1e-5)
        ember.config.cache_size_limit = old
        info = ember.cache_info(em)[0]["cudagraphs"]
        res["recordings_10_sizes"] = {"torch.compile": torch_graphs() - t0, "ember": info["pool"]["captures"],
                                      "ember_shapes": info["pool"]["shapes"], "mismatches": bad}
        print(f"10 batch sizes (1..10, MLP): CUDA graphs recorded: torch.compile={res['recordings_10_sizes']['torch.compile']}"
              f" ember={info['pool']['captures']} (buckets {sorted({s[0][0] for s in info['pool']['shapes']})})"
              f" mismatches={bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
