"""Differential sweep of torch's OpInfo database: each sample compiled with ember.compile,
torch.compile(backend="eager") and (on request) torch.compile(backend="inductor"), and compared
with eager PyTorch.

Invariant: every case is one freshly generated Python function `case(t0, t1, ...)` that calls
`op.op(sample.input, *sample.args, **sample.kwargs)` with the sample's tensors as its arguments and
every other value as a constant (a global of the function); each run gets fresh clones of the
tensors and the same seed, so eager and compiled runs see identical inputs. Nothing a compiler
does in one case (an exception, a wrong result) stops the sweep; a segfault does, with
faulthandler's traceback, and `--start-at OP` resumes after it.

    python -m ember.testing.opinfo_sweep --dtypes float32 --max-samples 2 --out docs/correctness.md

Compilers (--compilers, default "ember,torch"): ember = ember.compile(backend="eager"),
ember_codegen = ember.compile(backend="ember") (ember's own lowering, fusion and C kernels), torch =
torch.compile(backend="eager"), inductor = torch.compile(backend="inductor") (generates C++ for
the CPU samples: needs a C++ compiler, and seconds per case). Classes per case and compiler: pass
(compiled whole and equal to eager; for torch.compile: no graph break counted by dynamo), fallback
(equal to eager, but ember recorded a "fallback" entry / dynamo counted a graph break), wrong
(different values, dtypes, shapes, output structure or argument mutation), crash (an exception
where eager had none, or an exception of another type), mismatch (eager raised and the compiled
call did not, or raised the same type with another message). The JSON report (--json) holds
per-op counts (`results`), every case's classes (`cases`: [op, dtype, sample, {compiler: class}])
and the details of every case that did not pass (`failures`).

Sharding: `--shard K/N` runs only the selected ops (matching --ops, not random) whose index among
them is K mod N; `--merge A.json B.json ...` joins shard reports, or reports of runs with other
compilers over the same cases, into one (--json and/or --out). The sweep itself runs on the CPU;
on a 16-core host, 16 inductor shards in parallel (one compile thread each: the sweep sets
torch._inductor.config.compile_threads = 1 for a sharded run unless TORCHINDUCTOR_COMPILE_THREADS
is set; OMP_NUM_THREADS=1 keeps the processes from oversubscribing the cores):

    export TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=1
    for k in $(seq 0 15); do
      python -m ember.testing.opinfo_sweep --compilers inductor --shard $k/16 --json /tmp/ind_$k.json &
    done; wait
    python -m ember.testing.opinfo_sweep --compilers ember,torch --json /tmp/et.json
    python -m ember.testing.opinfo_sweep --merge /tmp/et.json /tmp/ind_*.json \\
        --json /tmp/all.json --out docs/correctness.md

(the ember,torch run can be sharded the same way; give every run the same --dtypes,
--max-samples and --no-error-inputs so that they run the same cases).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import re
import shlex
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.utils._pytree as pytree

CLASSES = ("pass", "fallback", "wrong", "crash", "mismatch")
COMPILERS = ("ember", "torch")  # the default; "inductor" on request
TORCH_BACKENDS = {"torch": "eager", "inductor": "inductor"}  # compiler key -> torch.compile backend
DISPLAY = {"ember": "ember.compile(eager)", "ember_codegen": "ember.compile(ember)", "torch": "torch.compile(eager)",
           "inductor": "torch.compile(inductor)"}
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


def run_ember(case: Case, seed: int, ref: Outcome, backend: str = "eager") -> tuple[str, str, bool]:
    """Compiles the case with ember (eager backend, or backend="ember" for the compiler key
    ember_codegen); the first call traces, the second hits."""
    import ember
    try:
        cf = ember.compile(case.make(), backend=backend)
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
    if cls == "fallback" and ref.exc is not None and _error_met_while_tracing(info, ref.exc):
        return "pass", "", inexact  # see ERROR_RULE
    if cls == "fallback":
        detail = why
    return cls, detail, inexact


# How a case whose sample makes eager raise is classified (docs/correctness.md quotes it).
ERROR_RULE = (
    "For a sample that makes eager raise, no compiler can compile the frame: the op raises while it "
    "is traced. Such a case passes when the compiler raises eager's exception (type and message) and "
    "did not fall back for another reason. torch.compile re-raises the error it met running the op on "
    "fake tensors (or wraps it in TorchRuntimeError: a crash); ember records the error it met running "
    "the op on meta tensors (a META_FAILED or RAISE entry whose exception has eager's type) and runs "
    "the frame eagerly, so the caller gets eager's own exception. Any other ember fallback on such a "
    "case (an unsupported call, say) stays a fallback.")


def _error_met_while_tracing(info, exc: BaseException) -> bool:
    """Did ember fall back only because tracing met eager's own error (ERROR_RULE)?"""
    fbs = [e for e in info if e.get("kind") == "fallback"]
    return bool(fbs) and all(
        e.get("reason") in ("META_FAILED", "RAISE")
        and str(e.get("detail") or "").startswith(type(exc).__name__ + ":") for e in fbs)


def run_torch_compile(case: Case, seed: int, ref: Outcome, backend: str = "eager") -> tuple[str, str, bool]:
    """Compiles the case with torch.compile(backend=backend) after torch._dynamo.reset(); a graph
    break counted by dynamo (counters["graph_break"], torch/_dynamo/utils.py), or a frame dynamo
    did not convert (counters["frames"]["ok"] unset) although eager returned, makes an equal
    result a fallback."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # each case is a fresh program: no skip marks or limits from earlier cases
    counters.clear()
    try:
        cf = torch.compile(case.make(), backend=backend)
    except Exception as e:  # noqa: BLE001
        return "crash", "torch.compile: " + _exc_text(e), False
    first = run_one(cf, case, seed)
    breaks = dict(counters.get("graph_break", {}))
    if ref.exc is None and not counters.get("frames", {}).get("ok"):
        breaks["dynamo did not convert the frame (counters['frames']['ok'] == 0)"] = 1
    broke = sum(breaks.values()) > 0
    cls, detail, inexact = classify(ref, first, broke)
    if cls == "fallback":
        detail = "; ".join(" ".join(str(k).split())[:160] for k in list(breaks)[:2])
    return cls, detail, inexact


RUNNERS = {"ember": run_ember, "ember_codegen": partial(run_ember, backend="ember"),
           **{c: partial(run_torch_compile, backend=b) for c, b in TORCH_BACKENDS.items()}}


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


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N) with 0 <= K < N; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard wants K/N with 0 <= K < N, not {text!r}")
    return int(m.group(1)), int(m.group(2))


def sweep(ops=None, dtypes=("float32",), max_samples=None, limit_ops=None, time_budget=None,
          compilers=COMPILERS, start_at=None, log=sys.stderr, keep=None, error_inputs=False, shard=None):
    """Runs the sweep; returns a dict with per-op counts, every case's classes, failure details
    and run metadata.

    ops: a regex searched (re.search) in each OpInfo's `name.variant`; keep: an optional
    predicate (op_full_name, dtype_name, sample_index) -> bool choosing cases (the CI subset);
    error_inputs: also run each op's error inputs (dtype name "errors"), which test exceptions;
    shard: (K, N) or "K/N": only the selected ops (matching ops, not random) whose index among
    them is K mod N. The index does not depend on start_at, so a shard resumes within itself.
    """
    if isinstance(shard, str):
        shard = parse_shard(shard)
    ember = None
    if "ember" in compilers or "ember_codegen" in compilers:
        import ember
    op_db = load_op_db()
    pattern = re.compile(ops) if ops else None
    t0 = time.monotonic()
    results = {}   # op name -> compiler -> class -> count
    cases = []     # [op, dtype, sample, {compiler: class}] for every case run
    failures = []  # dicts: op, dtype, sample, compiler, class, detail, source
    op_index = {}  # op name -> its position in op_db (merge_reports orders ops by it)
    inexact = {c: 0 for c in compilers}
    skipped_random = []
    started = start_at is None
    n_selected = -1
    n_ops = 0
    out_of_time = False
    for pos, op in enumerate(op_db):
        name = op_full_name(op)
        if not started and (name == start_at or op.name == start_at):
            started = True
        if pattern and not pattern.search(name):
            continue
        if is_random_op(op):
            if started:
                skipped_random.append(name)
            continue
        n_selected += 1
        if not started or shard is not None and n_selected % shard[1] != shard[0]:
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
        op_index[name] = pos
        if any(c in TORCH_BACKENDS for c in compilers):
            torch._dynamo.reset()
        if ember is not None:
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
                classes = {}
                cases.append([name, dname, idx, classes])
                for comp in compilers:
                    try:
                        cls, detail, inx = RUNNERS[comp](case, seed, ref)
                    except Exception as e:  # noqa: BLE001 - a bug of the harness or comparison
                        cls, detail, inx = "crash", "harness: " + _exc_text(e), False
                        if log is not None:
                            traceback.print_exc(file=log)
                    counts[comp][cls] += 1
                    classes[comp] = cls
                    inexact[comp] += bool(inx)
                    if cls != "pass":
                        failures.append(dict(op=name, dtype=dname, sample=idx, compiler=comp, cls=cls,
                                             detail=detail, source=case.source.strip()))
                    if inx:
                        again = run_one(case.make(), case, seed)  # is eager itself reproducible?
                        same = again.exc is None and compare(ref.value, again.value, exact=True) is None
                        failures.append(dict(op=name, dtype=dname, sample=idx, compiler=comp, cls="inexact",
                                             detail="equal within tolerance, not bitwise"
                                             + ("" if same else "; eager itself differs from run to run"),
                                             source=case.source.strip()))
        if ember is not None:
            ember.reset()
    return dict(results=results, failures=failures, inexact=inexact, skipped_random=skipped_random,
                error_inputs=error_inputs,
                seconds=round(time.monotonic() - t0, 1), out_of_time=out_of_time, compilers=list(compilers),
                dtypes=list(dtypes), torch=torch.__version__, python=sys.version.split()[0],
                shard=None if shard is None else f"{shard[0]}/{shard[1]}", op_index=op_index, cases=cases)


def _union(lists) -> list:
    """The items of several lists in order of first appearance, each once."""
    return list(dict.fromkeys(x for xs in lists for x in xs))


def merge_reports(reports: list) -> dict:
    """One report from several over the same kind of cases: the shards of a sweep, or runs with
    other compilers (one with ember,torch and one with inductor only), or both.

    results merge per op and compiler; an (op, compiler) pair that an earlier report already has
    is dropped from the later one, with its cases' classes and failures (listed in `dropped`),
    so that no case counts twice. cases merge by (op, dtype, sample); inexact counts are those of
    the kept `inexact` failures; seconds is the longest run; command joins the commands with ` ; `.
    """
    results: dict = {}
    owner: dict = {}    # (op, compiler) -> index of the report it is taken from
    dropped: list = []
    op_index: dict = {}
    for i, r in enumerate(reports):
        op_index.update({k: v for k, v in r.get("op_index", {}).items() if k not in op_index})
        for op, per in r["results"].items():
            for comp, counts in per.items():
                if (op, comp) in owner:
                    dropped.append(f"{op} {comp} (report {i})")
                    continue
                owner[op, comp] = i
                results.setdefault(op, {})[comp] = dict(counts)
    if all(op in op_index for op in results):  # op_db order, as one unsharded run lists them
        results = dict(sorted(results.items(), key=lambda kv: op_index[kv[0]]))
    order = {op: n for n, op in enumerate(results)}
    cases: dict = {}
    for i, r in enumerate(reports):
        for op, dtype, sample, classes in r.get("cases", []):
            entry = cases.setdefault((op, dtype, sample), {})
            for comp, cls in classes.items():
                if owner.get((op, comp)) == i:
                    entry.setdefault(comp, cls)
    failures, seen = [], set()
    for i, r in enumerate(reports):
        for f in r["failures"]:
            key = (f["op"], f["dtype"], f["sample"], f["compiler"], f["cls"], f["detail"])
            if key in seen or f["compiler"] != "-" and owner.get((f["op"], f["compiler"])) != i:
                continue
            seen.add(key)
            failures.append(f)
    failures.sort(key=lambda f: order.get(f["op"], len(order)))  # stable: keeps each op's order
    known = list(RUNNERS)
    compilers = sorted(_union(r["compilers"] for r in reports), key=lambda c: known.index(c) if c in known else 99)
    return dict(
        results=results, failures=failures,
        inexact={c: sum(1 for f in failures if f["compiler"] == c and f["cls"] == "inexact") for c in compilers},
        skipped_random=_union(r["skipped_random"] for r in reports),
        error_inputs=any(r.get("error_inputs") for r in reports),
        seconds=max(r["seconds"] for r in reports), out_of_time=any(r["out_of_time"] for r in reports),
        compilers=compilers, dtypes=_union(r["dtypes"] for r in reports),
        torch=" / ".join(_union([r["torch"]] for r in reports)),
        python=" / ".join(_union([r["python"]] for r in reports)),
        shard=None, merged_shards=[r.get("shard") for r in reports], dropped=dropped, op_index=op_index,
        cases=[[op, d, smp, cl] for (op, d, smp), cl in sorted(cases.items(), key=lambda kv: order.get(kv[0][0], -1))
               if cl],
        command=" ; ".join(r.get("command", "?") for r in reports))


def write_json(report, path: str) -> None:
    """The report as indented JSON, with one line per entry of `cases` (there are thousands)."""
    rest = {k: v for k, v in report.items() if k != "cases"}
    text = json.dumps(rest, indent=1, default=str)
    if "cases" in report:
        rows = ",\n  ".join(json.dumps(c, default=str) for c in report["cases"])
        text = text[:-2] + ',\n "cases": [\n  ' + rows + "\n ]\n}"  # text ends with "\n}"
    with open(path, "w") as f:
        f.write(text + "\n")


def totals(report) -> dict:
    """compiler -> class -> count over all ops."""
    tot = {c: dict.fromkeys(CLASSES, 0) for c in report["compilers"]}
    for per in report["results"].values():
        for comp, counts in per.items():
            for k, v in counts.items():
                tot[comp][k] += v
    return tot


def dtype_totals(report) -> dict:
    """compiler -> dtype -> class -> count, from the report's cases."""
    tot: dict = {c: {} for c in report["compilers"]}
    for _op, dtype, _sample, classes in report.get("cases", []):
        for comp, cls in classes.items():
            tot.setdefault(comp, {}).setdefault(dtype, dict.fromkeys(CLASSES, 0))[cls] += 1
    return tot


def head_to_head(report, other: str, first: str = "ember") -> dict:
    """first vs other on the cases both ran: counts of cases where only first passes, only other
    passes, both, neither; `other_only_cases` lists [op, dtype, sample, first's class] of the
    cases other passes and first does not."""
    h = dict(both_ran=0, first_only=0, other_only=0, both_pass=0, neither=0, other_only_cases=[])
    for op, dtype, sample, classes in report.get("cases", []):
        if first not in classes or other not in classes:
            continue
        h["both_ran"] += 1
        a, b = classes[first] == "pass", classes[other] == "pass"
        h["both_pass" if a and b else "first_only" if a else "other_only" if b else "neither"] += 1
        if b and not a:
            h["other_only_cases"].append([op, dtype, sample, classes[first]])
    return h


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


def _cell(text) -> str:
    """Text for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def to_markdown(report, command: str) -> str:
    """docs/correctness.md: command and date, totals (all, per dtype), head to head, failures,
    fallback reasons, one row per op and compiler."""
    comps = report["compilers"]
    tot = totals(report)
    name = lambda c: DISPLAY.get(c, c)  # noqa: E731
    others = [c for c in comps if c in TORCH_BACKENDS]
    commands = [f"    {c}" for c in command.split(" ; ")]
    merged = report.get("merged_shards")
    lines = [
        "# Correctness: OpInfo differential sweep",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by"
        + (f" merging the reports of {len(merged)} runs (`--merge`)" if merged else ""),
        "",
        *commands,
        "",
        f"torch {report['torch']}, Python {report['python']}, CPU, dtypes {', '.join(report['dtypes'])}"
        + (" and the OpInfos' error inputs (dtype `errors`)" if report.get("error_inputs") else "") + "; "
        f"{len(report['results'])} ops in {report['seconds']} s" + (" (the longest run)" if merged else "")
        + (" (stopped by --time-budget: later ops not run)" if report["out_of_time"] else "")
        + (f" (--shard {report['shard']}: only the selected ops whose index is K mod N)" if report.get("shard") else "")
        + ".",
        "Each case is one sample of torch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db)",
        "called through a generated function `case(t0, ...)` (tensors as arguments, everything else constant),",
        "compiled with " + ", ".join(f"`{name(c)}`" for c in comps) + " and compared with eager",
        "PyTorch: values (bitwise first, then assert_close's default tolerances with equal_nan), dtypes, shapes, output",
        "structure, arguments after the call, and exceptions (type and message). ember is also called a second time",
        "(the cached entry); torch.compile once. ember's and torch.compile's eager backends run eager's own kernels;",
        "inductor (`torch.compile(backend=\"inductor\")`) generates and compiles its own C++ kernels, so its results",
        "may differ from eager's within tolerance. Classes: **pass** compiled whole and equal (for torch.compile,",
        "with either backend: equal, no graph break counted by dynamo (`counters[\"graph_break\"]` empty) and the",
        "frame converted (`counters[\"frames\"][\"ok\"]`); dynamo is reset before each case);",
        "**fallback** equal, but ember ran the frame as Python (a fallback entry) / dynamo counted a graph break;",
        "**wrong** a different result; **crash** an exception where eager had none, or of another type; **mismatch**",
        "eager raised and the compiled call did not, or the same exception type with another message.",
        "torch.compile wraps an exception raised while it runs an op on fake tensors in TorchRuntimeError and",
        "appends \"from user code: ...\" to other messages (torch 2.13; 2.11 re-raises the error as it is): the",
        "caller sees another exception, so those count as crash / mismatch here.",
        "",
        ERROR_RULE,
        "",
        f"Skipped as random-valued or uninitialised ({len(report['skipped_random'])}): "
        + (", ".join(report["skipped_random"][:80]) or "none") + (" ..." if len(report["skipped_random"]) > 80 else "")
        + ".",
    ]
    if report.get("dropped"):
        lines += ["", f"Dropped while merging, as an earlier report had them ({len(report['dropped'])}): "
                  + ", ".join(report["dropped"][:20]) + (" ..." if len(report["dropped"]) > 20 else "") + "."]
    lines += [
        "",
        "## Totals",
        "",
        "| compiler | cases | " + " | ".join(CLASSES) + " | not bitwise (within tolerance) |",
        "|---|---:|" + "---:|" * len(CLASSES) + "---:|",
    ]
    for c in comps:
        n = sum(tot[c].values())
        lines.append(f"| {name(c)} | {n} | " + " | ".join(str(tot[c][k]) for k in CLASSES)
                     + f" | {report['inexact'].get(c, 0)} |")
    if "cases" in report:
        per_dtype = dtype_totals(report)
        lines += ["", "### Per dtype", "",
                  "| compiler | dtype | cases | " + " | ".join(CLASSES) + " |",
                  "|---|---|---:|" + "---:|" * len(CLASSES)]
        for c in comps:
            for d in sorted(per_dtype.get(c, {}), key=lambda d: (d == "errors", d)):
                counts = per_dtype[c][d]
                lines.append(f"| {name(c)} | {d} | {sum(counts.values())} | "
                             + " | ".join(str(counts[k]) for k in CLASSES) + " |")
    if "cases" in report and "ember" in comps and others:
        reasons = {}
        for f in report["failures"]:
            if f["compiler"] == "ember" and f["cls"] != "inexact":
                reasons.setdefault((f["op"], f["dtype"], f["sample"]), f["detail"])
        lines += ["", "## Head to head on the same cases", "",
                  "Only the cases that both compilers ran (runs merged from other sweeps may cover other cases);",
                  "\"passes\" is the class **pass**: compiled whole (no ember fallback, no dynamo graph break) and equal.",
                  "", "| ember vs | cases both ran | ember passes, the other does not | the other passes, ember does not"
                  " | both pass | neither passes |", "|---|---:|---:|---:|---:|---:|"]
        h2h = {o: head_to_head(report, o) for o in others}
        for o, h in h2h.items():
            lines.append(f"| {name(o)} | {h['both_ran']} | {h['first_only']} | {h['other_only']} | {h['both_pass']}"
                         f" | {h['neither']} |")
        for o, h in h2h.items():
            todo = h["other_only_cases"]
            lines += ["", f"### {name(o)} passes, ember does not ({len(todo)}"
                      + ("; the first 40" if len(todo) > 40 else "") + ")", ""]
            if not todo:
                lines.append("None.")
                continue
            lines += ["| op | dtype | sample | ember | ember's reason (fallback) or detail |", "|---|---|---:|---|---|"]
            for op, d, smp, cls in todo[:40]:
                lines.append(f"| {op} | {d} | {smp} | {cls} | {_cell(reasons.get((op, d, smp), ''))[:200]} |")
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
            lines.append(f"| {comp} | {cls} | {_cell(kind)} | {len(ops)} | {first} |")
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
                  "The eager backends replay the same kernels, so a difference there is either a kernel that is not",
                  "bitwise reproducible in eager itself (linalg.lstsq with the gelsy driver: two eager calls differ; runs",
                  "since the harness checks it say so) or a changed computation (torch.compile's addcdiv). inductor",
                  "generates its own kernels: its differences are expected.", "",
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
    gb: dict = {}
    for f in report["failures"]:
        if f["compiler"] in TORCH_BACKENDS and f["cls"] == "fallback":
            key = (f["compiler"], _cell(f["detail"].split("; ")[0])[:120])
            gb[key] = gb.get(key, 0) + 1
    if gb:
        lines += ["", "## torch.compile graph breaks (the first 30, by compiler and cases)", "",
                  "| compiler | graph break (dynamo's counter key) | cases |", "|---|---|---:|"]
        for (comp, k), v in sorted(gb.items(), key=lambda kv: (list(TORCH_BACKENDS).index(kv[0][0]), -kv[1]))[:30]:
            lines.append(f"| {name(comp)} | {k} | {v} |")
    lines += ["", "## Per op", "",
              "| op | compiler | " + " | ".join(CLASSES) + " |", "|---|---|" + "---:|" * len(CLASSES)]
    for op, per in report["results"].items():
        for c in comps:
            if c in per:
                lines.append(f"| {op} | {c} | " + " | ".join(str(per[c][k]) for k in CLASSES) + " |")
    return "\n".join(lines) + "\n"


def _print_totals(report) -> None:
    tot = totals(report)
    for c in report["compilers"]:
        print(f"{c}: " + " ".join(f"{k}={v}" for k, v in tot[c].items()) + f" inexact={report['inexact'].get(c, 0)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.testing.opinfo_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", help="regex searched in each OpInfo's name.variant (`^max\\.` for max's variants)")
    p.add_argument("--dtypes", default="float32", help="comma list of " + ",".join(DTYPES))
    p.add_argument("--max-samples", type=int, help="samples per op and dtype")
    p.add_argument("--limit-ops", type=int)
    p.add_argument("--time-budget", type=float, help="seconds; no new op starts after it")
    p.add_argument("--compilers", default="ember,torch", help="comma list of " + ",".join(RUNNERS))
    p.add_argument("--start-at", help="resume at this op (name or name.variant), after a crash")
    p.add_argument("--shard", metavar="K/N",
                   help="run only the selected ops whose index among them is K mod N (0 <= K < N)")
    p.add_argument("--out", help="Markdown report, e.g. docs/correctness.md")
    p.add_argument("--json", help="JSON report")
    p.add_argument("--render", metavar="JSON", help="only write --out from a JSON report of an earlier run")
    p.add_argument("--merge", metavar="JSON", nargs="+",
                   help="only merge JSON reports (shards, or other compilers over the same cases) into --json/--out")
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
    shard = None
    if a.shard:
        try:
            shard = parse_shard(a.shard)
        except ValueError as e:
            p.error(str(e))
    if a.render:
        with open(a.render) as f:
            report = json.load(f)
        with open(a.out or "/dev/stdout", "w") as f:
            f.write(to_markdown(report, report["command"]))
        return 0
    if a.merge:
        if not (a.json or a.out):
            p.error("--merge needs --json and/or --out")
        reports = []
        for path in a.merge:
            with open(path) as f:
                reports.append(json.load(f))
        report = merge_reports(reports)
        _print_totals(report)
        if report["dropped"]:
            print(f"dropped {len(report['dropped'])} (op, compiler) results already merged: "
                  + ", ".join(report["dropped"][:5]), file=sys.stderr)
        if a.json:
            write_json(report, a.json)
        if a.out:
            with open(a.out, "w") as f:
                f.write(to_markdown(report, report["command"]))
        return 0
    warnings.filterwarnings("ignore")
    torch._dynamo.config.suppress_errors = False
    if shard is not None and "inductor" in compilers and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        from torch._inductor import config as inductor_config
        inductor_config.compile_threads = 1  # N shard processes share the cores: no worker pools
    report = sweep(a.ops, dtypes, a.max_samples, a.limit_ops, a.time_budget, compilers, a.start_at,
                   error_inputs=not a.no_error_inputs, shard=shard)
    command = "python -m ember.testing.opinfo_sweep " + shlex.join(argv if argv is not None else sys.argv[1:])
    report["command"] = command
    _print_totals(report)
    if a.json:
        write_json(report, a.json)
    if a.out:
        with open(a.out, "w") as f:
            f.write(to_markdown(report, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
