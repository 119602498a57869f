"""Frontend overhead of ember vs torch.compile, measured like /work/shared/anchors/frontend_overhead.py.

Programs (as in the anchor): tiny = x * y + 1 on 8 floats; Mod(1) and Mod(100) = a ModuleList of
n modules each adding its Python int i. For each compiler the same custom backend hands the FX
graph to torch._inductor.compile_fx.compile_fx and keeps the compiled callable with its example
inputs. overhead = per-call time of the compiled function - per-call time of that callable called
directly (guards, argument handling, output building: everything the frontend adds).
Also measured, for context: plain eager, and torch.compile / ember with backend="eager"; and
"ember inductor pinned": the same ember calls under ember.pinned (the UNSAFE guard pin: no guard
runs), so "ember pin saves" = what guard evaluation costs per call.
Every figure is taken in this one process, interleaved over rounds; each keeps its minimum over
the rounds (least noise), each round's figure being the median of 3 timed loops (the anchor's rule).

usage: python bench/overhead.py [--json PATH] [--rounds N] [--calls N] [--no-ember] [--check]
       python -m ember bench [same options]
Last line has the anchor's format: 'frontend overhead us: torch tiny=.. mod1=.. mod100=.. | ember ...;
ratio max=..; ember mod100/mod1=..'. Exit 0, or with --check the anchor's verdict (ratio max <= 0.25
and mod100/mod1 <= 1.1). Timings are never asserted by tests.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import types

import torch


def per_call_us(fn, n=2000):
    """The anchor's timer: 200 warm-up calls, then the median of 3 loops of n calls, in µs."""
    for _ in range(200):
        fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(ts)


class Fi(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, x):
        return x + self.i


class Mod(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fs = torch.nn.ModuleList([Fi(i) for i in range(n)])

    def forward(self, x):
        for f in self.fs:
            x = f(x)
        return x


def tiny(x, y):
    return x * y + 1


def _clone_function(fn, tag):
    """fn with its own code object (a separate per-code cache in both compilers), same behaviour."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    g = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    g.__qualname__ = f"{fn.__qualname__}_{tag}"
    return g


_variants = {}


def _classes(tag):
    """(tiny, Fi, Mod) for a variant. "" is the anchor's own; other tags get copies whose code
    objects are distinct, so that the backend="eager" rows do not add cache entries to the code the
    Inductor rows run (which would make those rows' guard walks longer than the anchor's)."""
    if not tag:
        return tiny, Fi, Mod
    if tag not in _variants:
        fi = type(f"Fi_{tag}", (Fi,), {"forward": _clone_function(Fi.forward, tag)})
        mod_fwd = _clone_function(Mod.forward, tag)

        def mod_init(self, n, _fi=fi):
            torch.nn.Module.__init__(self)
            self.fs = torch.nn.ModuleList([_fi(i) for i in range(n)])
        mod = type(f"Mod_{tag}", (torch.nn.Module,), {"__init__": mod_init, "forward": mod_fwd})
        _variants[tag] = (_clone_function(tiny, tag), fi, mod)
    return _variants[tag]


def programs(tag=""):
    """{name: (program, args)} exactly as the anchor builds them."""
    t, _, mod = _classes(tag)
    a, b = torch.randn(8), torch.randn(8)
    x = torch.tensor([2])
    return {"tiny": (t, (a, b)), "mod1": (mod(1), (x,)), "mod100": (mod(100), (x,))}


ERRORS = []  # (compiler row, program, error) for programs that failed to compile or run


def _note_error(row, name, e):
    msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ERRORS.append((row, name, msg))


def prepare_inductor(compile_fn, reset, row):
    """The anchor's prepare(): {name: (compiled call, direct call of the backend's output)}.
    A program that fails is left out (and listed in ERRORS) instead of ending the benchmark."""
    from torch._inductor.compile_fx import compile_fx
    out = {}
    reset()
    for name, (prog, args) in programs().items():
        kept = []

        def backend(gm, example_inputs):
            g = compile_fx(gm, example_inputs)
            kept.append((g, list(example_inputs)))
            return g
        try:
            cf = compile_fn(prog, backend)
            cf(*args)
            if not kept:
                raise RuntimeError("the backend was never called (the frame was not captured as a graph)")
        except Exception as e:
            _note_error(row, name, e)
            continue
        g, ex = kept[-1]
        try:
            g(*ex)
            direct = lambda g=g, ex=ex: g(*ex)
        except Exception:  # Inductor's compiled output takes one boxed list of inputs
            direct = lambda g=g, ex=ex: g(list(ex))
        call = lambda cf=cf, args=args: cf(*args)
        call.compiled = cf
        out[name] = (call, direct)
    return out


def prepare_plain(compile_fn, tag, row):
    """{name: call} of each program compiled by compile_fn (identity for eager), on variant tag."""
    out = {}
    for name, (prog, args) in programs(tag).items():
        try:
            cf = compile_fn(prog)
            cf(*args)
        except Exception as e:
            _note_error(row, name, e)
            continue
        out[name] = lambda cf=cf, args=args: cf(*args)
    return out


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def measure(rows, rounds, calls):
    """rows: {row: {program: fn}}. Interleaves every figure over the rounds; keeps each minimum.
    A fn with a `context` attribute (a context-manager factory: ember.pinned) is timed inside it."""
    import contextlib
    best = {r: {p: float("inf") for p in fns} for r, fns in rows.items()}
    for _ in range(rounds):
        for r, fns in rows.items():
            for p, fn in fns.items():
                with getattr(fn, "context", contextlib.nullcontext)():
                    best[r][p] = min(best[r][p], per_call_us(fn, n=calls))
    return best


def pinned_rows(ember, prepared):
    """{program: call} of the Inductor-backed ember programs, each timed under ember.pinned (the
    UNSAFE guard pin: calls skip guard evaluation), to show what guard evaluation costs."""
    out = {}
    for name, (call, _) in prepared.items():
        def fn(call=call):
            return call()
        fn.context = lambda call=call: ember.pinned(call.compiled)
        out[name] = fn
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench/overhead.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5, as the anchor)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed loop (default 2000, as the anchor)")
    ap.add_argument("--no-ember", action="store_true", help="torch.compile only (compare torch with itself)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless ratio max <= 0.25 and mod100/mod1 <= 1.1")
    opts = ap.parse_args(argv)

    ember = None
    ember_error = None
    if not opts.no_ember:
        try:
            import ember
        except Exception as e:
            ember_error = f"{type(e).__name__}: {e}"
    second = "ember" if ember is not None else "torch2"

    t0 = time.perf_counter()
    ind = {"torch": prepare_inductor(lambda p, b: torch.compile(p, backend=b), torch._dynamo.reset, "torch")}
    if ember is not None:
        ind["ember"] = prepare_inductor(lambda p, b: ember.compile(p, backend=b), ember.reset, "ember")
    else:
        ind["torch2"] = prepare_inductor(lambda p, b: torch.compile(p, backend=b), torch._dynamo.reset, "torch2")
    rows = {"eager": prepare_plain(lambda p: p, "eager", "eager")}
    rows["torch.compile eager"] = prepare_plain(lambda p: torch.compile(p, backend="eager"), "torch_eager",
                                                "torch.compile eager")
    if ember is not None:
        rows["ember eager"] = prepare_plain(lambda p: ember.compile(p, backend="eager"), "ember_eager", "ember eager")
    for c, p in ind.items():
        rows[f"{c} inductor"] = {n: call for n, (call, _) in p.items()}
        rows[f"{c} inductor direct"] = {n: direct for n, (_, direct) in p.items()}
    if ember is not None:
        rows["ember inductor pinned"] = pinned_rows(ember, ind["ember"])
    compile_s = time.perf_counter() - t0
    best = measure(rows, opts.rounds, opts.calls)

    overhead = {c: {n: best[f"{c} inductor"][n] - best[f"{c} inductor direct"][n] for n in p}
                for c, p in ind.items()}
    na = float("nan")
    info = machine()
    print(f"machine: {info['platform']} | {info['cpu']} x{info['cpus']} (torch threads {info['torch_threads']}) | "
          f"Python {info['python']} | torch {info['torch']}" + (f" | {info['gpu']}" if info["gpu"] else ""))
    if ember_error:
        print(f"ember did not import ({ember_error}); comparing torch.compile with itself")
    print(f"per-call time in µs: min over {opts.rounds} interleaved rounds of the median of 3 loops of "
          f"{opts.calls} calls; compiling took {compile_s:.1f} s")
    names = ["tiny", "mod1", "mod100"]
    width = max(len(r) for r in rows) + 2
    print(f"{'':{width}s}" + "".join(f"{n:>10s}" for n in names))
    for r in rows:
        print(f"{r:{width}s}" + "".join(f"{best[r].get(n, na):10.2f}" for n in names))
    for c in ind:
        print(f"{c + ' overhead':{width}s}" + "".join(f"{overhead[c].get(n, na):10.2f}" for n in names))
    saved = {}
    if "ember inductor pinned" in rows:
        saved = {n: best["ember inductor"][n] - best["ember inductor pinned"][n] for n in rows["ember inductor pinned"]}
        print(f"{'ember pin saves':{width}s}" + "".join(f"{saved.get(n, na):10.2f}" for n in names))
    for row, name, msg in ERRORS:
        print(f"FAILED {row} {name}: {msg}")

    t, o = overhead["torch"], overhead[second]
    both = [n for n in names if n in t and n in o]
    ratio = max((o[n] / max(t[n], 1e-9) for n in both), default=na)
    scale = o["mod100"] / max(o["mod1"], 1e-9) if "mod1" in o and "mod100" in o else na
    fmt = lambda r: " ".join(f"{n}={r.get(n, na):.2f}" for n in names)
    print(f"frontend overhead us: torch {fmt(t)} | {second} {fmt(o)}; ratio max={ratio:.2f}; "
          f"{second} mod100/mod1={scale:.2f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"machine": info, "rounds": opts.rounds, "calls": opts.calls, "per_call_us": best,
                       "overhead_us": overhead, "pin_saves_us": saved, "ratio_max": ratio, "mod100_over_mod1": scale,
                       "second": second, "ember_error": ember_error,
                       "errors": [list(e) for e in ERRORS]}, f, indent=1)
    if opts.check:
        return 0 if ratio <= 0.25 and scale <= 1.1 and not ERRORS else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
