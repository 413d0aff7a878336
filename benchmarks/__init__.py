"""Benchmarks: how much faster is the GPU, and is it fed? Ratios measured side by side, one run.

    python -m benchmarks             # make bench (cli.py): training, data paths, inference
    python -m benchmarks.bench_prepare     # make bench-prepare: the prepare stage on 20,000 JPEGs

One module per thing measured: ``training`` (training throughput, GPU utilisation, time to a
target accuracy), ``datapaths`` (an image folder read four ways), ``inference`` (torch vs
ONNX Runtime), ``prepare`` (the prepare stage); ``timing`` is the one clock they all use,
``common`` the data, hardware and docs helpers, ``report`` the tables and chart.

Importing this package imports nothing heavy: ``bench.prepare`` must run without torch.
"""
