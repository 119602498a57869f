"""Counting what ember compiles: cache entries, graphs and skipped codes, over a block of calls.

    from ember.testing.counting import count_compiles
    with count_compiles() as c:
        model(x); model(x)
    c.entries, c.graphs, c.skipped     # made while the block ran

The C core emits one `ember.perf` record per cache entry it makes (every code, the frames the hook
meets included, which `ember.cache_info(fn)` does not list) and one `ember.recompiles` "skip"
record per code it stops compiling (docs/architecture.md, "Frames the hook skips"). The block turns
those two topics on, counts their records with a handler of its own (nothing is printed), and
restores the log topics that were on before. Used by tests/ and bench/ to compare compile counts
with torch.compile's.
"""
import logging

from .. import _logs


class count_compiles(logging.Handler):
    """Context manager; attributes entries (cache entries made), graphs (of those, entries that run
    a graph), skipped (codes the hook stopped compiling)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.entries = self.graphs = self.skipped = 0
        self._saved = None

    def emit(self, record):
        ev = getattr(record, "ember_event", None) or {}
        if record.name == "ember.recompiles":
            self.skipped += ev.get("event") == "skip"
        elif record.name == "ember.perf" and "info" in ev:
            self.entries += 1
            self.graphs += bool(ev["info"].get("ops"))

    def __enter__(self):
        self._saved = dict(_logs._levels)
        logging.getLogger("ember").addHandler(self)  # before _apply: no stderr handler is added
        levels = dict(self._saved)
        for topic in ("perf", "recompiles"):
            levels[topic] = min(levels.get(topic, logging.INFO), logging.INFO)
        _logs._apply(levels)
        return self

    def __exit__(self, *exc):
        _logs._apply(self._saved)
        logging.getLogger("ember").removeHandler(self)
        return False
