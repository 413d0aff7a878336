"""What every benchmark stands on, so each ``bench_*`` module holds only what it measures.

- ``clock``: the one clock (device-synchronised windows, medians after warm-up calls,
  seconds per item over a budget, rows repeated round robin);
- ``fit_window``: the timed window of a Lightning fit (imports lightning: GPU benchmarks);
- ``ratios``: side-by-side ratios of measured rows and their Markdown;
- ``publish``: provenance, the JSON report, and a benchmark's own section of
  docs/benchmarks.md (marked ``<!-- bench:KEY -->`` blocks or ``## Heading`` sections);
- ``host_facts``: the CPU, cores, load and library versions a figure was measured with;
- ``procs``: timed subprocesses, clones of the committed repository, their environment;
- ``rss``: the memory of the processes a benchmark starts (a tree's, a server's workers');
- ``made_once``: generated input folders made once and reused while their manifest matches;
- ``exported``: a dataset card and a Classifier exported as the export stage does.

Nothing here imports torch, lightning or onnxruntime at import time except ``fit_window``:
``make bench-prepare`` runs without torch and ``make gpu-check`` on a bare GPU machine.
"""
