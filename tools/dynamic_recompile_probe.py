"""Probe for issue 9 (docs/dynamic_shapes.md, "Known gap on CUDA"): does an attention program or
nn.TransformerEncoderLayer recompile per sequence length under dynamic=None? Runs each program over
five lengths on the given device, with ember's C shape rules on and off (config.sym_shape_rules),
and prints per entry: its kind, hits, the symbolic dims and specialisations ("dynamic" notes: which
dim is symbolic and why, what was specialised where, which ops needed torch's fake-tensor run), and
the guards that mention sizes. Also prints torch.compile's graph count for the same sequence.
On CPU (this VM, torch 2.13) both programs compile 2 graphs for 5 lengths either way.

usage: python tools/dynamic_recompile_probe.py [--device cuda|cpu] [--backend eager] [--lengths 5,7,9,12,16]
"""
import argparse

import torch

import ember


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(s, dim=-1) @ v


def programs(device):
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval().to(device)
    return {
        "attention": (attention, lambda n: tuple(torch.randn(2, n, 8, device=device) for _ in range(3))),
        "encoder (grad)": (lambda x: layer(x), lambda n: (torch.randn(2, n, 16, device=device),)),
        "encoder (no_grad, fast path)": (torch.no_grad()(lambda x: layer(x)),
                                         lambda n: (torch.randn(2, n, 16, device=device),)),
    }


def torch_count(f, make, lengths):
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, backend="eager")
    for n in lengths:
        cf(*make(n))
    return counters["stats"]["unique_graphs"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--lengths", default="5,7,9,12,16")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"torch {torch.__version__}, device {args.device}, backend {args.backend}, lengths {lengths}")
    for name, (f, make) in programs(args.device).items():
        for rules in (1, 0):
            ember.reset()
            ember.config.sym_shape_rules = rules
            cf = ember.compile(f, backend=args.backend)
            for n in lengths:
                a = make(n)
                torch.testing.assert_close(cf(*a), f(*a), rtol=1e-4, atol=1e-4)
            es = ember.cache_info(cf, resume=True)
            graphs = sum(1 for e in es if e["kind"] == "graph")
            print(f"\n== {name}: sym_shape_rules={rules}: {graphs} graphs for {len(lengths)} lengths")
            for i, e in enumerate(es):
                print(f"  entry {i}: kind {e['kind']}, hits {e.get('hits')}")
                for d in e.get("dynamic") or ():
                    print(f"    dynamic: {d}")
                for g in e.get("guards") or ():
                    if "size()" in g or "check_tensor" in g:
                        print(f"    guard:   {g}")
        ember.config.sym_shape_rules = 1
        try:
            print(f"  torch.compile (backend eager): {torch_count(f, make, lengths)} graphs")
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            print(f"  torch.compile failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
