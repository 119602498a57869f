"""Generated programs (ember.testing.program_gen) compiled with ember vs eager: a deterministic,
time-boxed subset of seeds must give no wrong result, crash or exception mismatch; plus checks
that the harness itself can fail (a wrong result, a crash, a mutated input are detected) and that
the shrinker keeps a failure while removing what it does not need.

The full sweep: python -m ember.testing.program_gen --count 2000 --seed 0
"""
import torch

from ember.testing import program_gen as pg

# Seeds that found an ember bug: each has a minimized reproducer in tests/regressions/ (marked
# xfail there until fixed) and is left out of this subset (these are outside range(150) today;
# they are listed so that widening the range keeps CI green until the fix). 363, 498: BatchNorm in
# train mode whose output is unused loses its running-stat update.
KNOWN_FAILING: dict[int, str] = {}  # seed -> regression file, while a bug is open

CI_SEEDS = [s for s in range(150) if s not in KNOWN_FAILING]


def test_generated_subset():
    failures = []
    totals = {c: 0 for c in pg.CLASSES}
    for seed in CI_SEEDS:
        cls, detail = pg.run_program(pg.generate(seed))
        totals[cls] += 1
        if cls in pg.FAILURES:
            failures.append(f"seed {seed}: {cls}: {detail}")
    assert not failures, "\n".join(failures)
    # the subset exercises captured graphs, graph breaks (frames split, resume functions) and fallbacks
    assert totals["pass"] > 50 and totals["break"] > 5, totals


# Seeds that found a bug since fixed, with the backend that showed it (the program itself is the
# regression test; each is also covered by a focused test named in the comment).
FIXED = [
    (61314, "eager"),      # x.mul_(0.5) of an int tensor lost the dict store before it (test_bad_input)
    (61219, "ember"),      # a dead floor_divide's NotImplemented backward raised (test_autograd)
    (61219, "aot_eager"),
    (62251, "ember"),      # a tuple input (x.max(dim)) without gradient was detached: AttributeError
    (62344, "aot_eager"),
    (96925, "ember"),      # a gradient built in place lost a tangent added into it (test_autograd)
    (100632, "aot_eager"),  # an output viewing another output, then an in-place update: autograd raised
    (190254, "aot_eager"),  # the min-cut saved an input eager does not save; updated later: backward raised
    (220373, "ember"),      # two new cells at a break, no plain local passed: their contents swapped
    (300272, "ember"),      # v.flatten() of a 1-D v returned with v: two objects, eager's one (test_autograd)
    (310195, "aot_eager"),  # v.contiguous() of a contiguous v returned with v: likewise
    (670184, "ember"),      # forward on the eager backend, backward on ember's: amax's self == result never
                            # held (ATen's cos vs libm's), a NaN gradient; both halves eager now
]
FIXED_AUTOCAST = [
    (72182, "aot_eager"),  # the divisor's gradient rounded otherwise than eager's in bfloat16 (test_autograd)
    (131767, "aot_eager"),  # x.contiguous() @ x: the rewrite cast one operand only, dot raised (test_autocast)
]


def test_special_values_and_partial_backward_are_written_into_the_source():
    """--special-values and --partial-backward are part of the program's source (a saved reproducer
    keeps them) and deterministic; the special values do reach the inputs."""
    prog = pg.generate(3, special=True, partial=True)
    src = prog.source()
    assert "def _special(" in src and "_special(torch.randn(" in src and f"BACKWARD = {prog.backward!r}" in src
    assert prog.backward in pg.BACKWARD_MODES and pg.generate(3, True, True).source() == src
    assert "_special" not in pg.generate(3).source() and "BACKWARD" not in pg.generate(3).source()
    nonfinite = 0
    for seed in range(10):
        ns = pg.load_source(pg.generate(seed, special=True).source(), f"<special-{seed}>")
        for args in ns["inputs"]():
            nonfinite += sum(int((~torch.isfinite(a)).sum()) for a in args
                             if isinstance(a, torch.Tensor) and a.is_floating_point())
    assert nonfinite > 0


def test_partial_backward_differentiates_the_chosen_outputs():
    x = torch.ones(3, requires_grad=True)
    for which, g in (("first", 2.0), ("last", 5.0), ("even", 7.0), ("odd", 3.0), ("all", 10.0)):
        x.grad = None
        grads = pg._backward([x], (x * 2, x * 3, x * 5), which)
        assert torch.equal(grads[0], torch.full((3,), g)), which


def test_generated_subset_special_values_partial_backward():
    """Training backends on programs with inf / NaN inputs where only some outputs get a gradient
    (an output without one must add nothing, NaN included, to the others' gradients)."""
    failures = []
    for backend in ("aot_eager", "ember"):
        for seed in range(1000, 1040):
            cls, detail = pg.run_program(pg.generate(seed, special=True, partial=True), backend=backend)
            if cls in pg.FAILURES:
                failures.append(f"seed {seed} ({backend}): {cls}: {detail}")
    assert not failures, "\n".join(failures)


def test_seeds_of_fixed_bugs():
    bad = []
    for seed, backend in FIXED:
        cls, detail = pg.run_program(pg.generate(seed), backend=backend)
        if cls in pg.FAILURES:
            bad.append(f"seed {seed} ({backend}): {cls}: {detail}")
    for seed, backend in FIXED_AUTOCAST:
        cls, detail = pg.run_program(pg.generate(seed), backend=backend, autocast=torch.bfloat16)
        if cls in pg.FAILURES:
            bad.append(f"seed {seed} ({backend}, bf16): {cls}: {detail}")
    assert not bad, "\n".join(bad)


def test_generation_is_deterministic():
    assert pg.generate(17).source() == pg.generate(17).source()
    assert pg.generate(17).source() != pg.generate(18).source()


def test_generated_source_defines_program_and_inputs():
    ns = pg.load_source(pg.generate(3).source(), "<t>")
    calls = ns["inputs"]()
    assert 2 <= len(calls) <= 3 and all(isinstance(c, tuple) for c in calls)
    for c in calls:
        ns["program"](*c)


def _fake_ember(monkeypatch, compiled_fn):
    """ember.compile replaced by a function returning compiled_fn (a stand-in for a buggy compiler)."""
    import ember
    monkeypatch.setattr(ember, "compile", lambda fn, backend="eager": compiled_fn)
    monkeypatch.setattr(ember, "cache_info", lambda fn, **kw: [])


def test_harness_detects_wrong_values(monkeypatch):
    def program(x):
        return x * 2
    _fake_ember(monkeypatch, lambda x: x * 2 + 1e-6)  # one float32 ulp-ish away
    assert pg.check(program, [(torch.ones(3),)])[0] == "wrong"


def test_harness_detects_wrong_mutation(monkeypatch):
    def program(x):
        x.add_(1)
        return x.sum()
    _fake_ember(monkeypatch, lambda x: (x + 1).sum())   # same value, input not mutated
    cls, detail = pg.check(program, [(torch.ones(3),)])
    assert cls == "wrong" and "arguments" in detail


def test_harness_detects_crash_and_mismatch(monkeypatch):
    def program(x):
        return x[5]
    _fake_ember(monkeypatch, lambda x: x[0])
    assert pg.check(program, [(torch.ones(3),)])[0] == "mismatch"

    def boom(x):
        raise RuntimeError("boom")
    _fake_ember(monkeypatch, boom)
    assert pg.check(lambda x: x + 1, [(torch.ones(3),)])[0] == "crash"


def test_harness_detects_dtype_and_stride(monkeypatch):
    _fake_ember(monkeypatch, lambda x: x.double())
    assert "dtype" in pg.check(lambda x: x + 0, [(torch.ones(3),)])[1]
    _fake_ember(monkeypatch, lambda x: x.t().contiguous())
    assert "stride" in pg.check(lambda x: x.t(), [(torch.ones(2, 3),)])[1]


def test_shrinker_keeps_the_failure_and_removes_the_rest():
    prog = next(p for p in map(pg.generate, range(200))
                if len(p.stmts) >= 4 and any("torch.sin(" in ln for s in p.stmts for ln in s.lines))

    def runner(p):  # a pretend bug: any program that still calls torch.sin "fails"
        return ("wrong", "sin") if "torch.sin(" in p.body_source(p.ret_expr()) else ("pass", "")

    small, detail = pg.shrink(prog, "wrong", budget_s=30, runner=runner)
    assert runner(small)[0] == "wrong" and detail == "sin"
    assert len(small.stmts) < len(prog.stmts) and len(small.shape_sets) == 1
    src = pg.regression_source(small, "wrong", detail)
    ns = pg.load_source(src, "<t>")
    assert callable(ns["program"]) and ns["inputs"]()


def test_harness_detects_lost_aliasing_and_wrong_gradients(monkeypatch):
    _fake_ember(monkeypatch, lambda x: x.clone())   # eager returns the input itself
    cls, detail = pg.check(lambda x: x, [(torch.ones(3),)])
    assert cls == "wrong" and "aliasing" in detail
    _fake_ember(monkeypatch, lambda x: (x * 2).detach().requires_grad_() + x)   # same value, other grad
    cls, detail = pg.check(lambda x: x * 3, [(torch.ones(3, requires_grad=True),)])
    assert cls == "wrong" and "gradients" in detail, detail


def test_tolerance_is_that_of_the_least_precise_dtype_computed_in(monkeypatch):
    """Backend "ember" (its own kernels): a float64 value computed from float32 data carries
    float32 rounding (seed 91: x.sum() in float32, then .double()), so it compares at float32's
    tolerances; a float64 value computed in float64 only keeps float64's; backend "eager" stays
    bitwise."""
    x32 = torch.linspace(-1, 1, 45).reshape(3, 5, 3)
    from_f32 = lambda x: x.sum().double() + x.double()                  # noqa: E731
    _fake_ember(monkeypatch, lambda x: from_f32(x) + 2e-6)              # a few float32 ulps off
    assert pg.check(from_f32, [(x32,)], backend="ember")[0] == "pass"
    assert pg.check(from_f32, [(x32,)], backend="eager")[0] == "wrong"
    _fake_ember(monkeypatch, lambda x: from_f32(x) + 1e-3)              # beyond float32's tolerance
    assert pg.check(from_f32, [(x32,)], backend="ember")[0] == "wrong"

    x64 = x32.double()
    in_f64 = lambda x: x.sum() + x                                       # noqa: E731
    _fake_ember(monkeypatch, lambda x: in_f64(x) + 2e-6)
    assert pg.check(in_f64, [(x64,)], backend="ember")[0] == "wrong"
    via_f32 = lambda x: (x.float() * 3).double() + x                     # noqa: E731 - a cast inside
    _fake_ember(monkeypatch, lambda x: via_f32(x) + 2e-6)
    assert pg.check(via_f32, [(x64,)], backend="ember")[0] == "pass"


def test_backend_ember_seeds_that_were_wrong():
    """program_gen --backend ember found these: 241, 316, 377, 598 (an input returned as another object),
    226 (zeros instead of None for an input with no gradient), 91 (float32 rounding compared at
    float64 tolerances: the harness), 929 (the tangent of an expanded output), 1090 and 1516 (strides of
    size-1 dims: the harness), 1874 (x[i] = v, v requiring grad, into an input). tests/py/test_autograd.py
    has the minimized cases."""
    for seed in (91, 226, 241, 316, 377, 598, 929, 1090, 1516, 1874):
        cls, detail = pg.run_program(pg.generate(seed), backend="ember")
        assert cls not in pg.FAILURES, f"seed {seed}: {cls}: {detail}"


def test_strides_of_size_one_dims_are_not_compared_for_other_backends(monkeypatch):
    """program_gen seeds 1090, 1516: x.t() / -3 of a (1, 4) x has strides (1, 4) on eager's CPU
    kernel, (1, 1) from torch's meta function (pytorch/pytorch#77553), which backend "ember" uses.
    A size-1 dim's stride addresses nothing: other backends compare the significant strides only
    (torch._prims_common.check_significant_strides); backend "eager" compares them all."""
    x = torch.randn(1, 4)
    prog = lambda x: x.t() / -3                                          # noqa: E731
    _fake_ember(monkeypatch, lambda x: torch.empty_strided((4, 1), (1, 1)).copy_(x.t() / -3))
    assert prog(x).stride() == (1, 4)
    assert pg.check(prog, [(x,)], backend="ember")[0] == "pass"
    assert "stride" in pg.check(prog, [(x,)], backend="eager")[1]
    y = torch.randn(3, 4)
    _fake_ember(monkeypatch, lambda y: y.t().contiguous() / -3)         # a significant stride differs
    assert "stride" in pg.check(lambda y: y.t() / -3, [(y,)], backend="ember")[1]


def test_generated_subset_under_autocast():
    """The same generated programs under CPU bfloat16 autocast with backend "ember" (autocast's
    casts written into the graph, symbolic sizes included): no wrong result, crash or exception
    mismatch, values within bfloat16's tolerances. The full sweep:
    python -m ember.testing.program_gen --count 1000 --backend ember --autocast bf16"""
    failures = []
    for seed in range(60):
        cls, detail = pg.run_program(pg.generate(seed), backend="ember", autocast=torch.bfloat16)
        if cls in pg.FAILURES:
            failures.append(f"seed {seed}: {cls}: {detail}")
    assert not failures, "\n".join(failures)
