"""Command line: `python -m ember demo [--only NAME] [--quiet]`, `python -m ember bench [...]` and
`python -m ember report DIR` (DIR/index.html from an ember.debug.dump directory).

demo: runs the example programs under ember, checks them against eager and shows graphs, guards,
fallback reasons and per-call times (src/ember/demo.py). bench: the frontend overhead benchmark
(bench/overhead.py in the source tree; its options follow, e.g. --json PATH).
"""
import argparse
import importlib.util
import sys
from pathlib import Path


def _bench_main(argv):
    path = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"
    if not path.is_file():
        print(f"ember bench: {path} not found; run from a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("ember_bench_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ember", description="ember: a JIT compiler for PyTorch programs")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,report}")
    sub.required = True
    demo = sub.add_parser("demo", help="run the example programs under ember and explain what it did")
    demo.add_argument("--only", metavar="NAME", action="append",
                      help="run only cases whose name contains NAME (repeatable; 'module.case' works too)")
    demo.add_argument("--quiet", action="store_true", help="one summary line per case")
    sub.add_parser("bench", help="frontend overhead benchmark vs torch.compile (options: see bench --help)",
                   add_help=False)
    report = sub.add_parser("report", help="write DIR/index.html from an ember.debug.dump directory")
    report.add_argument("dir", help="the dump directory")
    args, rest = parser.parse_known_args(argv)
    if args.command == "report":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from ember.debug import report as report_mod
        print(report_mod.render(args.dir))
        return 0
    if args.command == "bench":
        return _bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from ember import demo as demo_mod
    return demo_mod.run(only=args.only, quiet=args.quiet)


if __name__ == "__main__":
    sys.exit(main())
