"""The pipeline runs one way (DESIGN.md, "The pipeline": no stage calls back into an earlier one):
the stages' #include graph over csrc/<stage>/ must have no cycle. A file that glues two stages
together (test support, a driver) belongs to the later one. Issue 7 found csrc/ir/em_ir_testing.c
calling into runtime/, which itself builds on ir/."""
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)


def stage_graph():
    stages = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)))
    graph = {}
    for st in stages:
        deps = set()
        for name in os.listdir(os.path.join(ROOT, st)):
            if name.endswith((".c", ".h")):
                with open(os.path.join(ROOT, st, name), encoding="utf-8") as f:
                    deps.update(m for m in INCLUDE.findall(f.read()) if m in stages and m != st)
        graph[st] = deps
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if not state.get(m):
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if not state.get(n):
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_stage_includes_have_no_cycle():
    graph = stage_graph()
    assert {"core", "guard", "hook", "ir", "runtime", "trace"} <= set(graph), graph
    cycle = find_cycle(graph)
    assert cycle is None, "stages include each other: " + " -> ".join(cycle)


def test_early_stages_include_only_core():
    graph = stage_graph()
    assert graph["core"] == set()
    # sym/ is a leaf like core/ (docs/dynamic_shapes.md): sizes in IR metadata, sym guard programs
    assert graph.get("sym", set()) <= {"core"}, graph.get("sym")
    assert graph["ir"] <= {"core", "sym"}, graph["ir"]
    assert graph["guard"] <= {"core", "sym"}, graph["guard"]
    # passes/ rewrites graphs before autograd and lowering (issue 45): it may use ir/ and sym/, never
    # autograd/, lower/ or a later stage (autograd hands it what its rule table knows as a callback)
    assert graph["passes"] <= {"core", "ir", "sym"}, graph["passes"]
    assert "passes" in graph["autograd"], graph["autograd"]  # the joint graph is built with the rewriter


def test_c_files_and_drivers_stay_small():
    """Issue 45's budget: no C file over 3,000 lines (a file that outgrows it is split by concern)."""
    big = []
    for st in os.listdir(ROOT):
        d = os.path.join(ROOT, st)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            if name.endswith((".c", ".h")):
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    n = sum(1 for _ in f)
                if n > 3000:
                    big.append((f"{st}/{name}", n))
    assert not big, big


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
