"""Figures and a written summary of every benchmark's results.

(a) One PNG per results file: benchmarks/results/<name>.png.
(b) docs/benchmarks.md: each benchmark's figures against its target and the MinT paper.

Results are read defensively: a benchmark that has not run yet is "not run yet", a key that
is missing reads as "—", and a results file of a shape this module does not know still gets a
generic table (and plot) of its numbers.

    python -m benchmarks.report [--out DIR] [--docs PATH]

Modules: `data` (reading results), `verdicts` and `isolation` (figures against targets), `markdown`
(docs/benchmarks.md), `plots` (the PNGs; `plot_result` draws one as its benchmark finishes).
"""
