"""Cost of checking an entry's symbolic-shape guards: ember's compiled guard program (C, no
allocation) against the same guards evaluated as one Python lambda (what a Python guard function
would do). Not asserted anywhere (STYLE.md); run:

    .venv/bin/python bench/sym_guard.py [--rounds 7] [--iters 2000000]

The program is a typical entry's: x: [s0, s1] and y: [s2] (three size symbols) with four
relations asked while tracing (s0 > 4, s1 % 4 == 0, s0 < s2, s0*s1 <= 65536); its produced
guards add the symbols' ranges (6 checks in all). Figures are the minimum over interleaved rounds.
A second figure times what one small trace asks of the algebra (_sym_bench_trace).
"""

import argparse
import statistics
import timeit

import ember._C as C


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2_000_000)
    args = ap.parse_args()

    _, guards = C._sym_bench(1)
    src = "lambda L: " + " and ".join(f"({g})" for g in guards)
    check = eval(src)
    L = {"x": None, "y": None}

    class Sizes:  # L['x'].size()[0] in the rendered text: give it real tuples
        def __init__(self, *s):
            self.s = s

        def size(self):
            return self.s

    L = {"x": Sizes(8, 16), "y": Sizes(24)}
    assert check(L)
    c_ns, py_ns = [], []
    for _ in range(args.rounds):
        c_ns.append(C._sym_bench(args.iters)[0])
        n = max(1, args.iters // 20)
        py_ns.append(timeit.timeit(lambda: check(L), number=n) / n * 1e9)
    print("guards:")
    for g in guards:
        print("   ", g)
    print(f"C guard program : min {min(c_ns):7.1f} ns  median {statistics.median(c_ns):7.1f} ns per check of all {len(guards)}")
    print(f"Python lambda   : min {min(py_ns):7.1f} ns  median {statistics.median(py_ns):7.1f} ns (incl. .size() calls)")
    print(f"ratio (Python / C, min): {min(py_ns) / min(c_ns):.1f}x")
    trace_us = min(C._sym_bench_trace(max(1, args.iters // 200)) for _ in range(args.rounds)) / 1e3
    print(f"algebra for one small trace (env, 5 symbols, broadcast/strides/view/slice/conv/matmul,")
    print(f"  guards produced and compiled, freed): min {trace_us:7.2f} us")


if __name__ == "__main__":
    main()
