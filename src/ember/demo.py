"""`python -m ember demo`: runs every example program under ember and shows what ember did.

For each case of each module in examples/ (each exposes cases() -> [(name, callable_or_module,
[arg tuples])]) it compiles with ember.compile(backend="eager"), checks every call against eager
PyTorch (torch.testing.assert_close, exact tolerances: the eager backend replays the same ops),
prints the cache entries (graph as a table, guards, fallback reason, how the return value is
built); then compiles with ember's default backend, "ember" (ember's own C kernels), checks every
call again (assert_close's default tolerances: its kernels round transcendental functions
differently from eager's, within them) and names its kernels and extern calls; and times eager,
torch.compile(backend="eager"), ember with the eager backend and ember with its own kernels per
call in one process, interleaved over several rounds (median, microseconds). The first three run
eager's kernels, so they show the frontends' cost; the last shows what ember's kernels give.
Timings are never asserted anywhere.

The example programs live in the source tree (examples/ next to src/); EMBER_EXAMPLES=DIR points
the demo elsewhere. Exit status: 0 when every compiled result equals eager, 1 otherwise.
"""
import contextlib
import copy
import importlib.util
import io
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import ember

# Order of the demo: the tutorials first, whole models last.
EXAMPLE_MODULES = ("walk_through", "module_list", "dynamo_tutorial", "dissect", "models", "hf_models")


def examples_dir():
    """The examples/ folder: $EMBER_EXAMPLES, else <repo>/examples beside src/ember."""
    env = os.environ.get("EMBER_EXAMPLES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "examples"


def load_examples(directory=None):
    """Imports every example module (by file path, as ember_examples.<name>); returns them in demo
    order. Raises FileNotFoundError naming the folder when the examples are not there (ember was
    installed without its source tree)."""
    directory = Path(directory) if directory else examples_dir()
    mods = []
    for name in EXAMPLE_MODULES:
        path = directory / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(
                f"ember demo: example {path} not found; run from a source checkout "
                f"(pip install -e .) or set EMBER_EXAMPLES to the examples/ folder")
        qual = f"ember_examples.{name}"
        mod = sys.modules.get(qual)
        if mod is None or getattr(mod, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(qual, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[qual] = mod
            spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def all_cases(modules=None):
    """[(module short name, case name, callable_or_module, [arg tuples])] over every example."""
    out = []
    for mod in modules if modules is not None else load_examples():
        short = mod.__name__.rsplit(".", 1)[-1]
        for name, obj, arg_list in mod.cases():
            out.append((short, name, obj, arg_list))
    return out


def all_skipped(modules=None):
    """[(module short name, case name, why)] for cases this machine cannot run."""
    out = []
    for mod in modules if modules is not None else load_examples():
        short = mod.__name__.rsplit(".", 1)[-1]
        for name, why in getattr(mod, "skipped", lambda: [])():
            out.append((short, name, why))
    return out


def machine_description():
    """One line naming the machine: OS, CPU model and count, Python, torch, GPU if any."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.platform()} | {cpu} x{os.cpu_count()} | Python {platform.python_version()} | "
            f"torch {torch.__version__} | {gpu}")


def _calibrate(fn, target_s):
    """Calls per timing so that one measurement takes about target_s (3 to 5000)."""
    fn()
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(3, min(5000, int(target_s / dt)))


def time_interleaved(fns, rounds=5, target_s=0.01):
    """{name: fn} -> {name: median per-call µs}. Every round times every fn once, in turn, so that
    drifts in machine speed hit all of them alike."""
    n = {k: _calibrate(f, target_s) for k, f in fns.items()}
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(n[k]):
                f()
            samples[k].append((time.perf_counter() - t0) / n[k] * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def _compare(expected, got, where, exact=True):
    """Values, dtypes, shapes, structure: exactly (rtol=atol=0 through assert_close), or within
    assert_close's default tolerances when not exact (dtypes and shapes still exact)."""
    if isinstance(expected, torch.Tensor):
        tol = dict(rtol=0, atol=0) if exact else {}
        torch.testing.assert_close(got, expected, **tol, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected), f"{where}: {got!r} vs {expected!r}"
        for i, (e, g) in enumerate(zip(expected, got)):
            _compare(e, g, f"{where}[{i}]", exact)
    elif isinstance(expected, dict):
        assert type(got) is type(expected) and list(got) == list(expected), f"{where}: keys differ"
        for k in expected:
            _compare(expected[k], got[k], f"{where}[{k!r}]", exact)
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: {got!r} != {expected!r}"


def check_against_eager(obj, arg_list, compile_fn, exact=True):
    """Calls a compiled copy and an eager copy of obj on the same arguments (deep copies, so that
    state changes such as BatchNorm running statistics are compared too), each call from the same
    random-number state (dropout draws alike). Returns the compiled object. Raises AssertionError
    on any difference (beyond assert_close's default tolerances when not exact)."""
    eager_obj, eager_args = copy.deepcopy((obj, arg_list))
    comp_args = copy.deepcopy(arg_list)
    compiled = compile_fn(obj)
    for i, (ea, ca) in enumerate(zip(eager_args, comp_args)):
        rng = torch.get_rng_state()
        expected = eager_obj(*ea)
        torch.set_rng_state(rng)
        _compare(expected, compiled(*ca), f"call {i}", exact)
    if isinstance(obj, torch.nn.Module):
        _compare(dict(eager_obj.state_dict()), dict(obj.state_dict()), "state_dict after the calls", exact)
    return compiled


def describe_kernels(info):
    """One line on what backend "ember" made of the entries: kernels and extern calls per graph,
    or why a graph runs on the eager backend."""
    parts = []
    for e in info:
        em = e.get("ember")
        if e.get("kind") == "fallback" or not isinstance(em, dict):
            continue
        if em.get("fallback"):
            parts.append(f"eager backend ({em['fallback'].split(':')[0]})")
        else:
            parts.append(f"{em.get('kernels', 0)} kernel(s) + {em.get('externs', 0)} extern call(s)")
    return "; ".join(parts) if parts else "no graph"


def _indent(text, pad, limit=None):
    lines = text.rstrip("\n").splitlines()
    extra = 0
    if limit is not None and len(lines) > limit:
        extra = len(lines) - limit
        lines = lines[:limit]
    out = "\n".join(pad + ln for ln in lines)
    if extra:
        out += f"\n{pad}... {extra} more lines"
    return out


def describe_entries(info, pad="    "):
    """ember.cache_info(...) as readable text."""
    if not info:
        return pad + "(no cache entries)"
    parts = []
    for i, e in enumerate(info):
        if e.get("kind") == "graph":
            head = f"[{i}] graph, backend {e.get('backend')}, {e.get('hits', 0)} hits"
        else:
            where = ""
            if e.get("filename"):
                where = f" at {os.path.basename(str(e['filename']))}:{e.get('lineno')}"
            head = (f"[{i}] fallback: {e.get('reason')} ({e.get('reason_text')}){where}, "
                    f"{e.get('hits', 0)} hits")
            if e.get("detail"):
                head += f"\n{pad}    detail: {e['detail']}"
        parts.append(pad + head)
        guards = e.get("guards") or []
        parts.append(f"{pad}    guards ({len(guards)}):")
        parts.append(_indent("\n".join(guards), pad + "      ", limit=16) if guards else pad + "      (none)")
        if e.get("graph"):
            parts.append(f"{pad}    graph:")
            parts.append(_indent(e["graph"], pad + "      ", limit=40))
        if e.get("output"):
            parts.append(f"{pad}    return value: {e['output']}")
    return "\n".join(parts)


def _torch_compiled(obj):
    """torch.compile(backend="eager") of a deep copy, or None (with the error) if Dynamo fails."""
    try:
        c = torch.compile(copy.deepcopy(obj), backend="eager")
        return c, None
    except Exception as e:  # pragma: no cover - depends on the torch build
        return None, f"{type(e).__name__}: {e}"


def run_case(short, name, obj, arg_list, quiet=False, custom_backend=None, out=sys.stdout, bitwise=True):
    """Runs one case; prints its report; returns a summary dict (ok, kinds, timings). bitwise: the
    eager backend must equal eager to the bit (False for a case whose graph computes with other
    kernels than eager's, such as NumPy calls traced into torch ops: assert_close's tolerances)."""
    p = lambda *a: print(*a, file=out)
    kind = type(obj).__name__ if isinstance(obj, torch.nn.Module) else getattr(obj, "__qualname__", repr(obj))
    summary = {"case": name, "ok": False, "kinds": "", "us": {}}
    if not quiet:
        p(f"\n== {short}.{name}: {kind}, {len(arg_list)} calls ==")
    t0 = time.perf_counter()
    try:
        compiled = check_against_eager(obj, arg_list, lambda o: ember.compile(o, backend="eager"), exact=bitwise)
    except Exception:
        p(f"   {short}.{name}: MISMATCH OR ERROR against eager:")
        p(_indent(traceback.format_exc(), "     "))
        return summary
    summary["ok"] = True
    first_s = time.perf_counter() - t0
    info = ember.cache_info(compiled)
    summary["kinds"] = "+".join(e.get("kind", "?") for e in info) or "none"
    if not quiet:
        p(f"   equal to eager on every call (first calls incl. compiling: {first_s * 1e3:.0f} ms)")
        p("   cache entries, most recently used first:")
        p(describe_entries(info, pad="     "))

    # ember's default backend: its own kernels, compared within assert_close's tolerances
    try:
        kernels = check_against_eager(obj, arg_list, lambda o: ember.compile(o), exact=False)
        if not quiet:
            info_k = [e for e in ember.cache_info(kernels) if e.get("backend") == "ember"]
            p(f"   backend 'ember' (the default): equal to eager within assert_close's tolerances; "
              f"{describe_kernels(info_k)}")
    except Exception:
        summary["ok"] = False
        kernels = None
        p(f"   {short}.{name}: backend 'ember': MISMATCH OR ERROR against eager:")
        p(_indent(traceback.format_exc(), "     "))

    # Timing: one copy per implementation, same (last) arguments, interleaved rounds.
    args = arg_list[-1]
    eager_obj, eager_args = copy.deepcopy((obj, args))
    fns = {"eager": lambda: eager_obj(*eager_args)}
    tc, err = _torch_compiled(obj)
    if tc is not None:
        tc_args = copy.deepcopy(args)
        try:
            tc(*tc_args)
            fns["torch.compile"] = lambda: tc(*tc_args)
        except Exception as e:
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    em_args = copy.deepcopy(args)
    fns["ember"] = lambda: compiled(*em_args)
    if kernels is not None:
        k_args = copy.deepcopy(args)
        fns["ember kernels"] = lambda: kernels(*k_args)
    us = time_interleaved(fns)
    summary["us"] = us
    line = " | ".join(f"{k} {v:8.1f}" for k, v in us.items())
    if err:
        line += f" | torch.compile failed: {err}"
    if not quiet:
        p(f"   per call, µs (median of 5 interleaved rounds): {line}")
    elif err:
        p(f"   {name}: torch.compile failed: {err}")

    if custom_backend is not None and not quiet:
        p(f"   with a custom backend ({custom_backend.__name__}):")
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                check_against_eager(obj, arg_list[:1], lambda o: ember.compile(o, backend=custom_backend))
            printed = buf.getvalue()
            p(_indent(printed, "     ") if printed.strip() else
              "     (backend not called: the frame fell back, see the reason above)")
            p("     equal to eager")
        except Exception:
            summary["ok"] = False
            p(_indent(buf.getvalue() + traceback.format_exc(), "     "))
    return summary


def run(only=None, quiet=False, out=sys.stdout):
    """The demo. only: case names, or substrings of them ('chain', 'walk_through.'); an exact name
    selects only that case. Returns the exit status."""
    p = lambda *a: print(*a, file=out)
    t_start = time.perf_counter()
    p(f"ember demo on {machine_description()}")
    p("ember: backend 'eager' (graph replayed op by op: exact) and backend 'ember' (the default: ember's "
      f"C kernels); torch threads: {torch.get_num_threads()}")
    modules = load_examples()
    cases = all_cases(modules)
    skipped = all_skipped(modules)
    backends, not_bitwise = {}, set()
    for mod in modules:
        backends.update(getattr(mod, "CUSTOM_BACKENDS", {}))
        not_bitwise.update(getattr(mod, "NOT_BITWISE", ()))
    if only:
        names = {c[1] for c in cases} | {f"{c[0]}.{c[1]}" for c in cases}
        exact = [o for o in only if o in names]
        if exact:  # an exact case name selects just that case ('chain_1', not chain_100 too)
            sel = lambda s, n: n in exact or f"{s}.{n}" in exact
        else:
            sel = lambda s, n: any(o in n or o in f"{s}.{n}" for o in only)
        cases = [c for c in cases if sel(c[0], c[1])]
        skipped = [s for s in skipped if sel(s[0], s[1])]
        if not cases and not skipped:
            p(f"no example case matches {only}")
            return 2
    summaries = []
    for short, name, obj, arg_list in cases:
        ember.reset()
        summaries.append(run_case(short, name, obj, arg_list, quiet=quiet,
                                  custom_backend=backends.get(name), out=out, bitwise=name not in not_bitwise))
    for short, name, why in skipped:
        p(f"\n== {short}.{name}: skipped: {why}")

    p("\nsummary (µs per call; median of interleaved rounds, same process):")
    p(f"  {'':60s} {'(eager kernels)':^34s} {'ember kernels':>14s}")
    p(f"  {'case':28s} {'result':8s} {'entries':22s} {'eager':>9s} {'torch.compile':>14s} {'ember':>9s} "
      f"{'µs':>8s} {'vs eager':>8s}")
    for s in summaries:
        us = s["us"]
        fmt = lambda k: f"{us[k]:.1f}" if k in us else "-"
        ratio = f"{us['eager'] / us['ember kernels']:.2f}x" if "ember kernels" in us else "-"
        p(f"  {s['case']:28s} {'ok' if s['ok'] else 'FAIL':8s} {s['kinds'][:22]:22s} "
          f"{fmt('eager'):>9s} {fmt('torch.compile'):>14s} {fmt('ember'):>9s} {fmt('ember kernels'):>8s} {ratio:>8s}")
    for short, name, why in skipped:
        p(f"  {name:28s} skipped  {why}")
    failed = [s["case"] for s in summaries if not s["ok"]]
    p(f"\n{len(summaries) - len(failed)}/{len(summaries)} cases equal to eager"
      f"{'; FAILED: ' + ', '.join(failed) if failed else ''}; {time.perf_counter() - t_start:.1f} s in all")
    return 1 if failed else 0
