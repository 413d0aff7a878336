"""Benchmarks: how much faster is the GPU, and is it fed? Ratios measured side by side, one run.

Run from the repository root (this package is not in the wheel):

    python -m benchmarks                 # make bench: training, data paths, inference
    python -m benchmarks.bench_prepare   # make bench-prepare: the prepare stage on 20,000 JPEGs
    python -m benchmarks.bench_predict   # make bench-predict: bulk scoring vs a loop vs the service
    python -m benchmarks.bench_resume    # make bench-resume: what a resume after a SIGKILL saves
    python -m benchmarks.bench_serve     # make bench-serve: the service under load (wrk)
    python -m benchmarks.soak            # make soak: good and bad requests, errors and RSS

One module per thing measured: ``bench_training`` (training throughput, GPU utilisation,
time to a target accuracy), ``bench_datapaths`` (an image folder read four ways),
``bench_inference`` (torch vs ONNX Runtime), ``bench_prepare`` (the prepare stage, with
``prepare_photos``: its folder, and ``prepare_report``: its docs section),
``bench_resume`` (a resume after a SIGKILL), ``bench_predict`` (bulk scoring against a plain
loop and the service, with ``predict_inputs``: its photos, PNGs and models,
``predict_check``: its probabilities check, and ``predict_report``: its docs section);
``main`` runs the first three, ``common`` holds the
Fashion-MNIST data, ``training_figures`` the tables and chart. Every one of them stands on
``harness`` (the clock, ratios, host facts, subprocesses, made-once inputs, the JSON report
and its docs section). Serving: ``bench_serve`` (the load test's steps) with ``serve_load``
(request bodies, servers, wrk), ``serve_models`` (the larger model, ONNX Runtime alone),
``serve_figures`` (levels, targets, verdicts) and ``serve_report`` (its docs section);
``reference_server`` (the bare Starlette yardstick) and ``soak`` (the bounded soak test).

Importing this package imports nothing heavy: ``benchmarks.bench_prepare`` must run without
torch.
"""
