"""Probe for issue 7 (inductor recompiling on every call): compiles torchvision models with
ember.compile(backend="inductor") and reports per-call times, the cache entries, and what global
state the backend changed while compiling (module-class __dict__ entries, global hook dicts).
usage: python tools/inductor_recompile_probe.py [--device cuda|cpu] [--models resnet18,mobilenet_v2]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.modules.module as M

import ember

HOOK_DICTS = [n for n in dir(M) if n.startswith("_global_") and isinstance(getattr(M, n), dict)]


def class_snapshot(model):
    snap = {}
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls is object:
                continue
            snap[cls] = {k: id(v) for k, v in vars(cls).items()}
    return snap


def diff_snapshots(a, b):
    out = []
    for cls in a:
        ka, kb = a[cls], b.get(cls, {})
        added = sorted(set(kb) - set(ka))
        removed = sorted(set(ka) - set(kb))
        changed = sorted(k for k in ka if k in kb and ka[k] != kb[k])
        if added or removed or changed:
            out.append(f"  {cls.__module__}.{cls.__qualname__}: added {added} removed {removed} changed {changed}")
    return out


def log_global_hook_registrations():
    """Records who registers a global module hook (where from) while the backend compiles."""
    import traceback
    import torch.utils.hooks as H
    seen = []
    orig = H.RemovableHandle.__init__
    ids = {id(getattr(M, n)): n for n in HOOK_DICTS}

    def init(self, hooks_dict, *a, **k):
        if id(hooks_dict) in ids:
            seen.append((ids[id(hooks_dict)], "".join(traceback.format_stack(limit=8)[:-1])))
        orig(self, hooks_dict, *a, **k)
    H.RemovableHandle.__init__ = init
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    import torchvision
    for name in args.models.split(","):
        ember.reset()
        m = getattr(torchvision.models, name)().eval().to(args.device)
        x = torch.randn(4, 3, 64, 64, device=args.device)
        before = class_snapshot(m)
        hooks_before = {n: (len(getattr(M, n)), dict(getattr(M, n))) for n in HOOK_DICTS}
        seen = log_global_hook_registrations()
        cm = ember.compile(m, backend="inductor")
        times = []
        with torch.no_grad():
            ref = m(x)
            for _ in range(args.calls):
                t0 = time.perf_counter()
                y = cm(x)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        err = (y - ref).abs().max().item()
        info = ember.cache_info(cm)
        print(f"== {name} on {args.device}: call times (s) {[round(t, 3) for t in times]}; max abs err {err:.2e}")
        print(f"   {len(info)} entries: {[(e['kind'], e.get('reason'), e.get('hits')) for e in info]}")
        for e in info[:2]:
            if e.get("detail"):
                print("   detail:", str(e["detail"])[:400])
        if len(info) >= 2:
            g0, g1 = set(info[0]["guards"]), set(info[1]["guards"])
            print("   guards only in newest entry:", sorted(g0 - g1)[:12])
            print("   guards only in the one before:", sorted(g1 - g0)[:12])
        after = class_snapshot(m)
        d = diff_snapshots(before, after)
        print("   class dicts changed by compiling:", "none" if not d else "")
        for line in d[:30]:
            print(line)
        print(f"   global hook registrations during the calls: {len(seen)}")
        for which, stack in seen[:2]:
            print(f"   -- {which} registered from:\n{stack}")
        for n in HOOK_DICTS:
            print(f"   {n}: len {hooks_before[n][0]} -> {len(getattr(M, n))}")


if __name__ == "__main__":
    main()
