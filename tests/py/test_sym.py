"""Property tests of ember's symbolic sizes (csrc/sym) against Python's own integers.

Random expression trees over a few symbols are built through the C constructors (canonical,
hash-consed, simplified) and evaluated by C at many points; Python evaluates the original tree
(`//` and `%` with Python semantics) and also `eval`s the C renderer's Python text. Random
questions go through the shape environment's guard_bool; wherever the compiled guard program
admits other sizes, every question must get the same answer there, and the program must agree
with `eval` of the rendered guards. The test glue is ember._C._sym_eval / _sym_guards (not API).
"""

import random

import pytest

C = pytest.importorskip("ember._C")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OPS = ["add", "sub", "mul", "floordiv", "mod", "min", "max"]
CMPS = ["==", "!=", "<", "<=", ">", ">="]


def gen(rng, depth, nsyms, positive_divisors):
    if depth <= 0 or rng.random() < 0.25:
        if rng.random() < 0.5:
            return ("const", rng.randint(-6, 6))
        return ("sym", rng.randrange(nsyms))
    op = rng.choice(OPS)
    a = gen(rng, depth - 1, nsyms, positive_divisors)
    if op in ("floordiv", "mod") and (positive_divisors or rng.random() < 0.5):
        k = rng.randint(1, 6)
        b = ("const", k if positive_divisors or rng.random() < 0.7 else -k)
    else:
        b = gen(rng, depth - 1, nsyms, positive_divisors)
    return (op, a, b)


def ev(t, v):
    """Python's value of a tree, or None on division by zero."""
    op = t[0]
    if op == "const":
        return t[1]
    if op == "sym":
        return v[t[1]]
    a, b = ev(t[1], v), ev(t[2], v)
    if a is None or b is None:
        return None
    if op in ("floordiv", "mod") and b == 0:
        return None
    return {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "floordiv": lambda: a // b,
        "mod": lambda: a % b,
        "min": lambda: min(a, b),
        "max": lambda: max(a, b),
        "==": lambda: a == b,
        "!=": lambda: a != b,
        "<": lambda: a < b,
        "<=": lambda: a <= b,
        ">": lambda: a > b,
        ">=": lambda: a >= b,
    }[op]()


def env_of(v):
    return {"L": {f"s{i}": x for i, x in enumerate(v)}}


def guard_holds(g, v):
    """A rendered guard's truth at v; dividing by zero fails it, as the program's check does."""
    try:
        return bool(eval(g, env_of(v)))
    except ZeroDivisionError:
        return False


@pytest.mark.parametrize("sizes", [False, True], ids=["ints", "sizes"])
def test_random_expressions_match_python(sizes):
    rng = random.Random(1234 + sizes)
    compared = 0
    for _ in range(300):
        hints = [rng.randint(2, 9) if sizes else rng.randint(-9, 9) for _ in range(3)]
        tree = gen(rng, rng.randint(1, 4), 3, sizes)
        values = []
        for _ in range(12):
            v = [rng.randint(2, 40) if sizes else rng.randint(-30, 30) for _ in range(3)]
            if sizes:  # duck shaping made equal hints one symbol: give them equal values
                for i in range(3):
                    for j in range(i):
                        if hints[i] == hints[j]:
                            v[i] = v[j]
            values.append(v)
        err, sym_text, src_text, results = C._sym_eval(tree, hints, values, sizes)
        if err is not None:
            # only a constant division by zero or an over-large expansion may fail to build
            assert err in ("division or modulo by zero in a size expression", "size expression too large"), err
            continue
        for v, got in zip(values, results):
            want = ev(tree, v)
            if want is None:
                continue
            if got is None:  # overflow of the canonical form: allowed, never a wrong value
                continue
            compared += 1
            assert got == want, (tree, sym_text, v)
            assert eval(src_text, env_of(v)) == want, (tree, src_text, v)
    assert compared > 2000


def test_overflow_is_reported_not_wrapped():
    tree = ("mul", ("sym", 0), ("sym", 1))
    err, _, src, results = C._sym_eval(tree, [3, 5], [[2**40, 2**40], [2**31, 2**31], [-(2**32), 2**31]])
    assert err is None
    assert results == [None, 2**62, -(2**63)]
    assert C._sym_eval(("mul", ("const", 2**62), ("const", 2)), [], [[]])[0] == "integer overflow in a size expression"


def test_floor_semantics_on_negatives():
    values = [[a, b] for a in range(-9, 10) for b in range(-4, 5) if b]
    for op in ("floordiv", "mod"):
        _, _, src, results = C._sym_eval((op, ("sym", 0), ("sym", 1)), [7, 3], values)
        for (a, b), got in zip(values, results):
            assert got == (a // b if op == "floordiv" else a % b)
            assert eval(src, env_of([a, b])) == got


def test_rendering():
    _, sym, src, _ = C._sym_eval(("mod", ("mul", ("sym", 1), ("sym", 0)), ("const", 4)), [6, 10], [])
    assert sym == "Mod(s0*s1, 4)"
    assert src == "(L['s0'] * L['s1']) % 4"
    _, sym, _, _ = C._sym_eval(("max", ("floordiv", ("sym", 0), ("const", 2)), ("sym", 1)), [6, 10], [])
    assert sym == "Max(s1, (s0//2))"
    _, sym, _, _ = C._sym_eval(("add", ("sym", 0), ("sym", 0)), [6], [])
    assert sym == "2*s0"


def test_guards_readable_and_minimal():
    answers, guards, checks = C._sym_guards(
        [8, 12, 12],
        [(">", ("sym", 0), ("const", 4)), ("<", ("sym", 0), ("sym", 1)), (">=", ("sym", 0), ("const", 2))],
        [[8, 12, 12], [5, 6, 6], [4, 12, 12], [8, 8, 8], [8, 12, 13]],
    )
    assert answers == [True, True, True]
    assert guards == [
        "L['s2'] == L['s1']",  # duck shaping
        "5 <= L['s0']",
        "2 <= L['s1']",
        "L['s0'] < L['s1']",
    ]
    assert checks[:2] == [-1, -1] and all(c >= 0 for c in checks[2:])


@pytest.mark.parametrize("sizes", [True, False], ids=["sizes", "ints"])
def test_random_guards_are_sound(sizes):
    """Sizes a guard program admits give every question the answer it had at the example."""
    rng = random.Random(99 + sizes)
    admitted = 0
    for _ in range(150):
        hints = [rng.randint(2, 8) if sizes else rng.randint(-8, 8) for _ in range(3)]
        questions = [
            (rng.choice(CMPS), gen(rng, rng.randint(0, 2), 3, True), gen(rng, rng.randint(0, 2), 3, True))
            for _ in range(4)
        ]
        trials = [
            [h if rng.random() < 0.4 else (rng.randint(0, 12) if sizes else rng.randint(-12, 12)) for h in hints]
            for _ in range(40)
        ]
        # symbols are numbered by creation; with 0/1 specialised, a hint of 0/1 is no symbol
        answers, guards, checks = C._sym_guards(hints, questions, trials, sizes)
        if checks is None or None in answers:
            continue
        for q, a in zip(questions, answers):
            want = ev(q, hints)  # None: Python divides by zero where the canonical form need not
            assert want is None or bool(want) == a, (q, hints)
        for v, c in zip(trials, checks):
            holds = all(guard_holds(g, v) for g in guards)
            assert holds == (c == -1), (guards, v, c)
            if c != -1:
                continue
            admitted += 1
            for q, a in zip(questions, answers):
                got = ev(q, v)
                if got is not None:
                    assert bool(got) == a, (q, v, guards)
    assert admitted > 300
