"""Differential sweep of torch's OpInfo database: each sample compiled with ember.compile and
torch.compile (backend="eager") and compared with eager PyTorch.

Invariant: every case is one freshly generated Python function `case(t0, t1, ...)` that calls
`op.op(sample.input, *sample.args, **sample.kwargs)` with the sample's tensors as its arguments and
every other value as a constant (a global of the function); each run gets fresh clones of the
tensors and the same seed, so eager and compiled runs see identical inputs. Nothing a compiler
does in one case (an exception, a wrong result) stops the sweep; a segfault does, with
faulthandler's traceback, and `--start-at OP` resumes after it.

    python -m ember.testing.opinfo_sweep --dtypes float32 --max-samples 2 --out docs/correctness.md

Classes per case and compiler: pass (compiled whole and equal to eager), fallback (equal to eager,
but ember recorded a "fallback" entry / dynamo recorded a graph break), wrong (different values,
dtypes, shapes, output structure or argument mutation), crash (an exception where eager had none,
or an exception of another type), mismatch (eager raised and the compiled call did not, or raised
the same type with another message).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

CLASSES = ("pass", "fallback", "wrong", "crash", "mismatch")
COMPILERS = ("ember", "torch")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool}

# Ops whose outputs are random at call time or uninitialised memory: never comparable with eager.
RANDOM_OPS = re.compile(
    r"rand|normal|bernoulli|dropout|multinomial|uniform|exponential|geometric|cauchy|log_normal"
    r"|empty|poisson"
)


def op_full_name(op) -> str:
    """The OpInfo's name with its variant, as test names spell it: `max.reduction_with_dim`."""
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def is_random_op(op) -> bool:
    """True for ops whose samples give random-valued (or uninitialised) outputs."""
    return bool(RANDOM_OPS.search(op_full_name(op))) or bool(getattr(op, "has_nondeterministic_output", False))


def load_op_db():
    """torch's OpInfo list (importing it needs the expecttest package)."""
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


# ---------------------------------------------------------------------------------------------
# Building one case function


@dataclass
class Case:
    """One sample as a function of its tensors: fn(*tensors) == op.op(input, *args, **kwargs)."""
    source: str
    tensors: list
    consts: dict
    callee: object
    label: str = "case"

    def make(self):
        """A new function object (with a new code object) for the case. The file name is the
        case's label, so dynamo's per-code state (automatic dynamic shapes, keyed by file name,
        line and function name) does not carry from one sample to the next."""
        g = {"__builtins__": __builtins__, "OP": self.callee}
        g.update(self.consts)
        exec(compile(self.source, f"<opinfo {self.label}>", "exec"), g)
        return g["case"]


def build_case(callee, sample, label: str = "case") -> Case:
    """The source of `def case(t0, ...): return OP(<input>, <args>, <kwargs>)` for a sample."""
    tensors: list = []
    consts: dict = {}

    def expr(v) -> str:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return f"t{len(tensors) - 1}"
        if type(v) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v)):
            inner = ", ".join(expr(x) for x in v)
            return f"[{inner}]" if type(v) is list else f"({inner},)"
        if v is None or v is True or v is False:
            return repr(v)
        if type(v) in (int, str) or (type(v) is float and math.isfinite(v)):
            return repr(v)
        name = f"C{len(consts)}"
        consts[name] = v
        return name

    parts = [expr(sample.input)] + [expr(a) for a in sample.args]
    for k, v in sample.kwargs.items():
        if k.isidentifier():
            parts.append(f"{k}={expr(v)}")
        else:
            parts.append(f"**{{{k!r}: {expr(v)}}}")
    params = ", ".join(f"t{i}" for i in range(len(tensors)))
    source = f"def case({params}):\n    return OP({', '.join(parts)})\n"
    return Case(source, tensors, consts, callee, label)


# ---------------------------------------------------------------------------------------------
# Running and comparing


@dataclass
class Outcome:
    """What one call gave: a value (or None) and an exception (or None), plus the args after."""
    value: object = None
    exc: BaseException | None = None
    args_after: list = field(default_factory=list)


def run_one(fn, case: Case, seed: int) -> Outcome:
    """Calls fn on fresh clones of the case's tensors under a fixed seed; catches everything."""
    args = [t.clone() for t in case.tensors]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation warnings of samples: the same in every run
        try:
            return Outcome(value=fn(*args), args_after=args)
        except Exception as e:  # noqa: BLE001 - every failure is data here
            return Outcome(exc=e, args_after=args)


def _same_leaf(a, b, exact: bool) -> str | None:
    """None if two output leaves agree, else a one-line difference."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"type {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} vs {b.dtype}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.layout != b.layout or a.is_sparse or a.layout != torch.strided:
            return None if a.layout == b.layout else f"layout {a.layout} vs {b.layout}"
        try:
            if exact:
                torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(b, a, equal_nan=True)
        except AssertionError as e:
            return "values: " + " ".join(str(e).split())[:300]
        return None
    if type(a) is not type(b):
        return f"type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        same = bool(a == b)
    except Exception:  # noqa: BLE001
        same = repr(a) == repr(b)
    return None if same else f"value {a!r} vs {b!r}"


def compare(expected, got, exact: bool) -> str | None:
    """None if got equals expected (structure, container types, leaves), else a difference."""
    el, es = pytree.tree_flatten(expected)
    gl, gs = pytree.tree_flatten(got)
    if es != gs:
        return f"structure {str(es)[:120]} vs {str(gs)[:120]}"
    if type(expected) is not type(got):
        return f"type {type(expected).__name__} vs {type(got).__name__}"
    for i, (a, b) in enumerate(zip(el, gl)):
        d = _same_leaf(a, b, exact)
        if d:
            return f"output leaf {i}: {d}"
    return None


def _exc_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def classify(ref: Outcome, got: Outcome, broke: bool) -> tuple[str, str, bool]:
    """(class, detail, inexact) of a compiled outcome against the eager one."""
    if ref.exc is not None:
        if got.exc is None:
            return "mismatch", f"eager raised {_exc_text(ref.exc)}; compiled returned", False
        if type(got.exc) is not type(ref.exc):
            return "crash", f"eager raised {_exc_text(ref.exc)}; compiled raised {_exc_text(got.exc)}", False
        if str(got.exc) != str(ref.exc):
            return "mismatch", f"eager: {_exc_text(ref.exc)}; compiled: {_exc_text(got.exc)}", False
        return ("fallback" if broke else "pass"), "", False
    if got.exc is not None:
        return "crash", _exc_text(got.exc), False
    inexact = False
    for exp, val, what in ((ref.value, got.value, "output"), (ref.args_after, got.args_after, "arguments after")):
        d = compare(exp, val, exact=True)
        if d is not None:
            if compare(exp, val, exact=False) is not None:
                return "wrong", f"{what}: {d}", False
            inexact = True
    return ("fallback" if broke else "pass"), "", inexact


# ---------------------------------------------------------------------------------------------
# The compilers


def run_ember(case: Case, seed: int, ref: Outcome) -> tuple[str, str, bool]:
    """Compiles the case with ember (eager backend); the first call traces, the second hits."""
    import ember
    try:
        cf = ember.compile(case.make(), backend="eager")
    except Exception as e:  # noqa: BLE001
        return "crash", "ember.compile: " + _exc_text(e), False
    first = run_one(cf, case, seed)
    try:
        info = ember.cache_info(cf)
    except Exception as e:  # noqa: BLE001
        return "crash", "ember.cache_info: " + _exc_text(e), False
    broke = any(e.get("kind") == "fallback" for e in info)
    why = ""
    if broke:
        fb = next(e for e in info if e.get("kind") == "fallback")
        why = f"{fb.get('reason')}: {' '.join(str(fb.get('detail') or '').split())[:160]}"
    cls, detail, inexact = classify(ref, first, broke)
    if cls in ("pass", "fallback"):
        second = run_one(cf, case, seed)  # the cached entry (direct dispatch from C)
        c2, d2, i2 = classify(ref, second, broke)
        if c2 not in ("pass", "fallback"):
            cls, detail = c2, "second call: " + d2
        inexact = inexact or i2
    if cls == "fallback":
        detail = why
    return cls, detail, inexact


def run_torch(case: Case, seed: int, ref: Outcome) -> tuple[str, str, bool]:
    """Compiles the case with torch.compile(backend="eager"); graph breaks counted by dynamo."""
    from torch._dynamo.utils import counters
    counters.clear()
    try:
        cf = torch.compile(case.make(), backend="eager")
    except Exception as e:  # noqa: BLE001
        return "crash", "torch.compile: " + _exc_text(e), False
    first = run_one(cf, case, seed)
    breaks = counters.get("graph_break", {})
    broke = sum(breaks.values()) > 0
    cls, detail, inexact = classify(ref, first, broke)
    if cls == "fallback":
        detail = "; ".join(" ".join(str(k).split())[:160] for k in list(breaks)[:2])
    return cls, detail, inexact


RUNNERS = {"ember": run_ember, "torch": run_torch}


# ---------------------------------------------------------------------------------------------
# The sweep


def iter_cases(op, dtype, max_samples: int | None):
    """(index, Case or exception) for the op's first max_samples samples, seeded per op and dtype;
    dtype None: the op's error inputs (op.error_inputs, samples that eager rejects)."""
    torch.manual_seed(0)
    try:
        if dtype is None:
            samples = (e.sample_input for e in op.error_inputs("cpu"))
        else:
            samples = op.sample_inputs("cpu", dtype, requires_grad=False)
        for i, s in enumerate(samples):
            if max_samples is not None and i >= max_samples:
                return
            dname = "errors" if dtype is None else str(dtype).replace("torch.", "")
            yield i, build_case(op.op, s, f"{op_full_name(op)} {dname} {i}")
    except Exception as e:  # noqa: BLE001 - the OpInfo itself failed to make samples
        yield -1, e


def sweep(ops=None, dtypes=("float32",), max_samples=None, limit_ops=None, time_budget=None,
          compilers=COMPILERS, start_at=None, log=sys.stderr, keep=None, error_inputs=False):
    """Runs the sweep; returns a dict with per-op counts, failure details and run metadata.

    ops: a regex searched (re.search) in each OpInfo's `name.variant`; keep: an optional
    predicate (op_full_name, dtype_name, sample_index) -> bool choosing cases (the CI subset);
    error_inputs: also run each op's error inputs (dtype name "errors"), which test exceptions.
    """
    import ember
    op_db = load_op_db()
    pattern = re.compile(ops) if ops else None
    t0 = time.monotonic()
    results = {}   # op name -> compiler -> class -> count
    failures = []  # dicts: op, dtype, sample, compiler, class, detail, source
    inexact = {c: 0 for c in compilers}
    skipped_random = []
    started = start_at is None
    n_ops = 0
    out_of_time = False
    for op in op_db:
        name = op_full_name(op)
        if not started:
            if name != start_at and op.name != start_at:
                continue
            started = True
        if pattern and not pattern.search(name):
            continue
        if is_random_op(op):
            skipped_random.append(name)
            continue
        if limit_ops is not None and n_ops >= limit_ops:
            break
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            out_of_time = True
            break
        supported = op.supported_dtypes("cpu")
        todo = [d for d in dtypes if DTYPES[d] in supported]
        if error_inputs and todo and op.error_inputs_func is not None:
            todo.append("errors")
        if not todo:
            continue
        n_ops += 1
        if log is not None:
            print(f"[{time.monotonic() - t0:7.1f}s] {name}", file=log, flush=True)
        counts = results.setdefault(name, {c: dict.fromkeys(CLASSES, 0) for c in compilers})
        if "torch" in compilers:
            torch._dynamo.reset()
        ember.reset()
        for dname in todo:
            for idx, case in iter_cases(op, DTYPES.get(dname), max_samples):
                if keep is not None and not keep(name, dname, idx):
                    continue
                if isinstance(case, Exception):
                    failures.append(dict(op=name, dtype=dname, sample=idx, compiler="-", cls="samples",
                                         detail="sample_inputs: " + _exc_text(case), source=""))
                    break
                seed = 1234 + idx
                ref = run_one(case.make(), case, seed)
                for comp in compilers:
                    try:
                        cls, detail, inx = RUNNERS[comp](case, seed, ref)
                    except Exception as e:  # noqa: BLE001 - a bug of the harness or comparison
                        cls, detail, inx = "crash", "harness: " + _exc_text(e), False
                        if log is not None:
                            traceback.print_exc(file=log)
                    counts[comp][cls] += 1
                    inexact[comp] += bool(inx)
                    if cls not in ("pass", "fallback") or comp == "ember" and cls == "fallback":
                        failures.append(dict(op=name, dtype=dname, sample=idx, compiler=comp, cls=cls,
                                             detail=detail, source=case.source.strip()))
                    if inx:
                        again = run_one(case.make(), case, seed)  # is eager itself reproducible?
                        same = again.exc is None and compare(ref.value, again.value, exact=True) is None
                        failures.append(dict(op=name, dtype=dname, sample=idx, compiler=comp, cls="inexact",
                                             detail="equal within tolerance, not bitwise"
                                             + ("" if same else "; eager itself differs from run to run"),
                                             source=case.source.strip()))
        ember.reset()
    return dict(results=results, failures=failures, inexact=inexact, skipped_random=skipped_random,
                error_inputs=error_inputs,
                seconds=round(time.monotonic() - t0, 1), out_of_time=out_of_time, compilers=list(compilers),
                dtypes=list(dtypes), torch=torch.__version__, python=sys.version.split()[0])


def totals(report) -> dict:
    """compiler -> class -> count over all ops."""
    tot = {c: dict.fromkeys(CLASSES, 0) for c in report["compilers"]}
    for per in report["results"].values():
        for comp, counts in per.items():
            for k, v in counts.items():
                tot[comp][k] += v
    return tot


def failure_kind(detail: str) -> str:
    """A failure's detail without its messages: `eager RuntimeError, compiled TorchRuntimeError`."""
    m = re.match(r"eager raised (\w+): .*; compiled raised (\w+):", detail)
    if m:
        return f"eager raised {m.group(1)}, compiled raised {m.group(2)}"
    m = re.match(r"eager: (\w+): .*; compiled: (\w+):", detail)
    if m:
        return f"same {m.group(1)}, another message"
    m = re.match(r"eager raised (\w+): .*; compiled returned", detail)
    if m:
        return f"eager raised {m.group(1)}, compiled returned"
    m = re.match(r"(\w+): ", detail)
    if m and not detail.startswith(("output", "arguments")):
        return f"raised {m.group(1)}"
    return detail.split(":")[0][:60]


def to_markdown(report, command: str) -> str:
    """docs/correctness.md: command and date, totals, one row per op and compiler, failures."""
    comps = report["compilers"]
    tot = totals(report)
    lines = [
        "# Correctness: OpInfo differential sweep",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by",
        "",
        f"    {command}",
        "",
        f"torch {report['torch']}, Python {report['python']}, CPU, dtypes {', '.join(report['dtypes'])}"
        + (" and the OpInfos' error inputs (dtype `errors`)" if report.get("error_inputs") else "") + "; "
        f"{len(report['results'])} ops in {report['seconds']} s"
        + (" (stopped by --time-budget: later ops not run)" if report["out_of_time"] else "") + ".",
        "Each case is one sample of torch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db)",
        "called through a generated function `case(t0, ...)` (tensors as arguments, everything else constant),",
        "compiled with `ember.compile(backend=\"eager\")` and `torch.compile(backend=\"eager\")` and compared with eager",
        "PyTorch: values (bitwise first, then assert_close's default tolerances with equal_nan), dtypes, shapes, output",
        "structure, arguments after the call, and exceptions (type and message). ember is also called a second time",
        "(the cached entry). Classes: **pass** compiled whole and equal; **fallback** equal, but ember ran the frame",
        "as Python (a fallback entry) / dynamo had a graph break; **wrong** a different result; **crash** an exception",
        "where eager had none, or of another type; **mismatch** eager raised and the compiled call did not, or the",
        "same exception type with another message.",
        "torch.compile wraps an exception raised while it runs an op on fake tensors in TorchRuntimeError and",
        "appends \"from user code: ...\" to other messages: the caller sees another exception, so those count as",
        "crash / mismatch here. ember runs each op on meta tensors while tracing; when that raises, the frame",
        "falls back (META_FAILED) and the eager call raises eager's own exception.",
        "",
        f"Skipped as random-valued or uninitialised ({len(report['skipped_random'])}): "
        + ", ".join(report["skipped_random"][:80]) + (" ..." if len(report["skipped_random"]) > 80 else "") + ".",
        "",
        "## Totals",
        "",
        "| compiler | cases | " + " | ".join(CLASSES) + " | not bitwise (within tolerance) |",
        "|---|---:|" + "---:|" * len(CLASSES) + "---:|",
    ]
    names = {"ember": "ember.compile(eager)", "torch": "torch.compile(eager)"}
    for c in comps:
        n = sum(tot[c].values())
        lines.append(f"| {names[c]} | {n} | " + " | ".join(str(tot[c][k]) for k in CLASSES)
                     + f" | {report['inexact'][c]} |")
    bad = [f for f in report["failures"] if f["cls"] not in ("pass", "fallback", "inexact")]
    lines += ["", "## Failures (wrong / crash / mismatch) by kind", ""]
    if not bad:
        lines.append("None.")
    else:
        kinds: dict = {}
        for f in bad:
            key = (f["compiler"], f["cls"], failure_kind(f["detail"]))
            kinds.setdefault(key, []).append(f["op"])
        lines += ["| compiler | class | kind | cases | ops (first 8) |", "|---|---|---|---:|---|"]
        for (comp, cls, kind), ops in sorted(kinds.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
            first = ", ".join(list(dict.fromkeys(ops))[:8])
            lines.append(f"| {comp} | {cls} | {kind} | {len(ops)} | {first} |")
        lines += ["", "## Failures (the first 60 per compiler)", "",
                  "| op | dtype | sample | compiler | class | detail |", "|---|---|---:|---|---|---|"]
        shown: dict = {}
        for f in bad:
            shown[f["compiler"]] = shown.get(f["compiler"], 0) + 1
            if shown[f["compiler"]] > 60:
                continue
            detail = f["detail"].replace("|", "\\|")[:240]
            lines.append(f"| {f['op']} | {f['dtype']} | {f['sample']} | {f['compiler']} | {f['cls']} | {detail} |")
    inexact = [f for f in report["failures"] if f["cls"] == "inexact"]
    if inexact:
        lines += ["", "## Equal within tolerance but not bitwise", "",
                  "The eager backend replays the same kernels, so a difference here is either a kernel that is not",
                  "bitwise reproducible in eager itself (linalg.lstsq with the gelsy driver: two eager calls differ; runs",
                  "since the harness checks it say so) or a changed computation (torch.compile's addcdiv).", "",
                  "| op | dtype | sample | compiler | detail |",
                  "|---|---|---:|---|---|"]
        lines += [f"| {f['op']} | {f['dtype']} | {f['sample']} | {f['compiler']} | {f['detail']} |" for f in inexact]
    fb = {}
    for f in report["failures"]:
        if f["compiler"] == "ember" and f["cls"] == "fallback":
            key = f["detail"].split(":")[0]
            fb[key] = fb.get(key, 0) + 1
    if fb:
        lines += ["", "## ember fallback reasons", "", "| reason | cases |", "|---|---:|"]
        for k, v in sorted(fb.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {v} |")
    lines += ["", "## Per op", "",
              "| op | compiler | " + " | ".join(CLASSES) + " |", "|---|---|" + "---:|" * len(CLASSES)]
    for op, per in report["results"].items():
        for c in comps:
            lines.append(f"| {op} | {c} | " + " | ".join(str(per[c][k]) for k in CLASSES) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.testing.opinfo_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", help="regex searched in each OpInfo's name.variant (`^max\\.` for max's variants)")
    p.add_argument("--dtypes", default="float32", help="comma list of " + ",".join(DTYPES))
    p.add_argument("--max-samples", type=int, help="samples per op and dtype")
    p.add_argument("--limit-ops", type=int)
    p.add_argument("--time-budget", type=float, help="seconds; no new op starts after it")
    p.add_argument("--compilers", default="ember,torch")
    p.add_argument("--start-at", help="resume at this op (name or name.variant), after a crash")
    p.add_argument("--out", help="Markdown report, e.g. docs/correctness.md")
    p.add_argument("--json", help="JSON report")
    p.add_argument("--render", metavar="JSON", help="only write --out from a JSON report of an earlier run")
    p.add_argument("--no-error-inputs", action="store_true",
                   help="skip the OpInfos' error inputs (samples eager rejects; they test exceptions)")
    a = p.parse_args(argv)
    faulthandler.enable()
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    compilers = [c.strip() for c in a.compilers.split(",") if c.strip()]
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d}")
    for c in compilers:
        if c not in RUNNERS:
            p.error(f"unknown compiler {c}")
    if a.render:
        with open(a.render) as f:
            report = json.load(f)
        with open(a.out or "/dev/stdout", "w") as f:
            f.write(to_markdown(report, report["command"]))
        return 0
    warnings.filterwarnings("ignore")
    torch._dynamo.config.suppress_errors = False
    report = sweep(a.ops, dtypes, a.max_samples, a.limit_ops, a.time_budget, compilers, a.start_at,
                   error_inputs=not a.no_error_inputs)
    command = "python -m ember.testing.opinfo_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    report["command"] = command
    tot = totals(report)
    for c in compilers:
        print(f"{c}: " + " ".join(f"{k}={v}" for k, v in tot[c].items()) + f" inexact={report['inexact'][c]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(to_markdown(report, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
