"""The contenders of ``benchmarks.bench_predict``: ``trainyard predict`` itself (1, a
subprocess), the plain loop (2, in this process) with what each part of an image costs
alone, posting every file to ``bentoml serve`` (3), and the memory check's run of predict
on many small files with its process tree's RSS (5)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.host_facts import usable_cores
from benchmarks.harness.rss import tree_memory
from benchmarks.harness.stopwatch import Timer, per_item_s
from benchmarks.predict_inputs import REPO
from benchmarks.predict_report import GROWTH_LIMIT
from benchmarks.serve_load import BOUNDARY, multipart_body, start_server, stop_server
from trainyard.bulk.table import summary_path

MODULE = "benchmarks.bench_predict"
SAMPLE_S = 0.5


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- 1. predict


def clear_output(out: Path) -> None:
    """Remove an earlier run's table, summary and chunks (a leftover job would resume)."""
    out.unlink(missing_ok=True)
    summary_path(out).unlink(missing_ok=True)
    shutil.rmtree(out.parent / f".{out.name}.parts", ignore_errors=True)


def predict_command(source: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainyard.bulk",
        str(source),
        "--out",
        str(out),
        "--model",
        str(model),
        *extra,
    ]


def cli_command(source: Path, out: Path, model: Path) -> list[str]:
    """``trainyard predict`` as a user types it (the console script beside this Python),
    without the MLflow run: it would write into the repository's tracking store."""
    script = Path(sys.executable).with_name("trainyard")
    args = [str(source), "--out", str(out), "--model", str(model), "--no-track"]
    return [str(script), "predict", *args]


def run_predict(
    source: Path, out: Path, model: Path, *extra: str, cli: bool = False
) -> dict[str, Any]:
    """``python -m trainyard.bulk`` (``cli``: ``trainyard predict``) as a subprocess from the
    repository (its params.yaml); its summary plus ``wall_s`` (the whole process) and its
    log."""
    clear_output(out)
    cmd = cli_command(source, out, model) if cli else predict_command(source, out, model, *extra)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench-predict: {' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads(summary_path(out).read_text())
    return {
        "summary": summary,
        "wall_s": wall,
        "loadavg": [load, os.getloadavg()[0]],
        "log": proc.stderr.strip().splitlines()[-3:],
    }


def predict_row(run: dict[str, Any], count: int) -> dict[str, Any]:
    s, speed = run["summary"], run["summary"]["speed"]
    if s["scored"] != count:
        raise SystemExit(f"bench-predict: predict scored {s['scored']} of {count} files")
    return {
        "images": s["scored"],
        "img_per_s": speed["img_per_s"],
        "seconds": speed["seconds"],
        "wall_s": run["wall_s"],
        "wall_img_per_s": s["scored"] / run["wall_s"],
        "batch_size": speed["batch_size"],
        "workers": speed["workers"],
        "provider": speed["provider"],
        "decode_wait_share": speed["decode_wait_share"],
        "inference_share": speed["inference_share"],
        "verdict": speed["verdict"],
        "scoring": speed.get("scoring"),
        "place": speed.get("place"),
        "first_row_s": speed.get("first_row_s"),
        "loadavg": run["loadavg"],
    }


# ----------------------------------------------------------------------------- 2. plain loop


def model_card(model: Path) -> Any:
    """The dataset card the exported model carries (size, channels, mean/std, classes)."""
    import onnxruntime as ort

    from trainyard.core.card import card_from_metadata

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return card_from_metadata(dict(session.get_modelmeta().custom_metadata_map), str(model))


def plain_loop(files: list[Path], model: Path, card: Any, keep: set[int]) -> dict[str, Any]:
    """What a user writes by hand: one file at a time, PIL then ONNX Runtime at batch 1.
    Returns the row and the probabilities of the files whose index is in ``keep``."""
    import onnxruntime as ort
    from PIL import Image

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name, logits_out = session.get_inputs()[0].name, [session.get_outputs()[0].name]
    mode = "L" if card.channels == 1 else "RGB"
    size = (card.width, card.height)
    mean = np.asarray(card.mean, np.float32).reshape(-1, 1, 1)
    std = np.asarray(card.std, np.float32).reshape(-1, 1, 1)
    # Output 0 only (the logits), as predict asks: an embedding output is not copied back.
    session.run(logits_out, {name: np.zeros((1, *card.input_shape), np.float32)})  # warm-up
    kept: dict[int, list[float]] = {}
    load = os.getloadavg()[0]
    with Timer() as clock:
        for i, path in enumerate(files):
            im = Image.open(path).convert(mode).resize(size)
            x = np.asarray(im, np.float32) / 255.0
            x = x[None] if mode == "L" else x.transpose(2, 0, 1)
            x = (x - mean) / std
            logits = session.run(logits_out, {name: x[None]})[0][0]
            if i in keep:
                e = np.exp(logits - logits.max())
                kept[i] = (e / e.sum()).tolist()
    dt = clock.seconds
    row = {
        "images": len(files),
        "seconds": dt,
        "img_per_s": len(files) / dt,
        "loadavg": [load, os.getloadavg()[0]],
    }
    return {"row": row, "probabilities": kept}


def costs(files: list[Path], model: Path, card: Any, seconds: float) -> dict[str, Any]:
    """What one image costs here, each part alone, in this process: the bulk decode
    (``decode_image`` with predict's limits) and the plain loop's PIL calls on up to 64
    of the files; ONNX Runtime at batch 64 on one intra-op thread and on one per core, at
    batch 1 on one thread, and the plain loop's session at batch 1. ``ceiling``: the img/s
    of predict if decode and inference shared the cores perfectly: cores / (decode + the
    better of batch 1 and 64 on one thread, per image)."""
    import math

    import onnxruntime as ort
    from PIL import Image

    from trainyard.runtime.inputs import decode_image
    from trainyard.runtime.sessions import load_onnx

    sample = [p.read_bytes() for p in files[:64]]
    mode = "L" if card.channels == 1 else "RGB"
    size = (card.width, card.height)
    out: dict[str, Any] = {"files": len(sample)}

    def bulk_decode() -> None:
        for data in sample:
            decode_image(data, card, max_pixels=10**9, field="file", max_aspect_ratio=math.inf)

    def plain_decode() -> None:
        for path in files[: len(sample)]:
            Image.open(path).convert(mode).resize(size)

    out["decode_ms"] = 1000 * per_item_s(bulk_decode, len(sample), seconds)
    out["plain_decode_ms"] = 1000 * per_item_s(plain_decode, len(sample), seconds)
    batch = np.zeros((64, *card.input_shape), np.float32)
    for threads, key in ((1, "infer_b64_1thread_ms"), (0, "infer_b64_ms")):
        session = load_onnx(model, device="cpu", intra_op_threads=threads, say=False)
        out[key] = 1000 * per_item_s(lambda s=session: s.run(batch), len(batch), seconds)
    single = load_onnx(model, device="cpu", intra_op_threads=1, say=False)
    out["infer_b1_1thread_ms"] = 1000 * per_item_s(lambda: single.run(batch[:1]), 1, seconds)
    # predict's workers run one thread each at the batch its probe finds fastest
    out["infer_1thread_ms"] = min(out["infer_b1_1thread_ms"], out["infer_b64_1thread_ms"])
    plain = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name, one, logits_out = plain.get_inputs()[0].name, batch[:1], [plain.get_outputs()[0].name]
    out["infer_b1_default_ms"] = 1000 * per_item_s(
        lambda: plain.run(logits_out, {name: one}), 1, seconds
    )
    cores = usable_cores()
    out["cores"] = cores
    out["ceiling_img_per_s"] = 1000 * (cores or 1) / (out["decode_ms"] + out["infer_1thread_ms"])
    return out


# ----------------------------------------------------------------------------- 3. service


class Client:
    """One keep-alive connection to the service, posting one file per request."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def classify(self, path: Path, top_k: int | None = None) -> dict[str, Any]:
        body = multipart_body(path.read_bytes(), path.name, "image/jpeg")
        query = f"?top_k={top_k}" if top_k else ""
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        self.conn.request("POST", f"/classify{query}", body, headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise SystemExit(f"bench-predict: /classify {path}: {resp.status} {data[:300]!r}")
        return json.loads(data)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.conn.close()


def post_all(url: str, files: list[Path], threads: int) -> dict[str, Any]:
    """Every file posted to /classify by ``threads`` clients (one connection each), each
    taking the next file when its answer came back; the row."""
    lock = threading.Lock()
    nxt = iter(range(len(files)))
    errors: list[BaseException] = []

    def worker() -> None:
        client = Client(url)
        try:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                client.classify(files[i])
        except BaseException as err:  # SystemExit too: reported after the join
            errors.append(err)
        finally:
            client.close()

    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if threads == 1:
        worker()
    else:
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"bench-predict: posting failed: {errors[0]}")
    return {
        "images": len(files),
        "seconds": dt,
        "img_per_s": len(files) / dt,
        "clients": threads,
        "loadavg": [load, os.getloadavg()[0]],
    }


def service_rows(
    model: Path, files: list[Path], threads: int, check: list[int], classes: int, tmp: Path
) -> dict[str, Any]:
    """Start the service as bench-serve does, warm it up, post every file sequentially and
    from ``threads`` clients, then ask for the ``check`` files' full probabilities."""
    log("3. the service: bentoml serve (params.yaml as it is), TRAINYARD_MODEL = the model")
    proc, url, ready_s = start_server(REPO / "params.yaml", model, tmp / f"serve-{model.stem}.log")
    log(f"   ready in {ready_s:.1f} s at {url}")
    out: dict[str, Any] = {"ready_s": ready_s}
    try:
        warm = files[: min(len(files), 16)]
        post_all(url, warm, 1)
        post_all(url, warm, max(threads, 1))
        out["sequential"] = post_all(url, files, 1)
        log(f"   posting, sequential:    {out['sequential']['img_per_s']:8.1f} img/s")
        if threads > 1:
            out["threads"] = post_all(url, files, threads)
            log(f"   posting, {threads} threads:     {out['threads']['img_per_s']:8.1f} img/s")
        client = Client(url)
        try:
            out["answers"] = {i: client.classify(files[i], top_k=classes) for i in check}
        finally:
            client.close()
    finally:
        stop_server(proc)
    return out


# ----------------------------------------------------------------------------- 5. memory


def memory_run(tiny: Path, count: int, model: Path, work: Path) -> dict[str, Any]:
    """Score the tiny folder with ``python -m trainyard.bulk`` while sampling its tree, in
    one decode worker per core (``--workers``: auto would score such small images in its
    own process; the workers' tree is the one whose memory could grow)."""
    out = work / "million.parquet"
    clear_output(out)
    cmd = predict_command(tiny, out, model, "--workers", str(usable_cores() or 1))
    samples: list[tuple[float, int, int, int, int]] = []
    t0 = time.perf_counter()
    with open(work / "million.log", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        while proc.poll() is None:
            rss, pss, n, own = tree_memory(proc.pid)
            if n:
                samples.append((time.perf_counter() - t0, rss, pss, n, own))
            time.sleep(SAMPLE_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"bench-predict: {' '.join(cmd)} failed:\n{(work / 'million.log').read_text()[-3000:]}"
        )
    summary = json.loads(summary_path(out).read_text())
    return memory_figures(samples, summary, wall, count)


def memory_figures(
    samples: list[tuple[float, int, int, int, int]],
    summary: dict[str, Any],
    wall: float,
    count: int,
) -> dict[str, Any]:
    """Start, peak and growth of the tree's RSS. Scoring runs while the decode workers are
    up: the window is the samples with the most processes; start = its first sample."""
    if not samples:
        raise SystemExit("bench-predict: no memory sample taken")
    most = max(s[3] for s in samples)
    window = [s for s in samples if s[3] == most]
    start, peak = window[0], max(samples, key=lambda s: s[1])
    quarter = window[len(window) // 4]
    end = window[-1]
    return {
        "images": count,
        "scored": summary["scored"],
        "img_per_s": summary["speed"]["img_per_s"],
        "seconds": summary["speed"]["seconds"],
        "wall_s": wall,
        "processes": most,
        "samples": len(samples),
        "sample_every_s": SAMPLE_S,
        "start_rss": start[1],
        "start_pss": start[2],
        "peak_rss": peak[1],
        "peak_pss": max(s[2] for s in samples),
        "growth_rss": peak[1] - start[1],
        "late_growth_rss": end[1] - quarter[1],  # the last quarter-to-end of scoring: flat?
        "main_start_rss": start[4],
        "main_peak_rss": max(s[4] for s in samples),
        "limit": GROWTH_LIMIT,
        "within": peak[1] - start[1] <= GROWTH_LIMIT,
        # A few points of the curve for the report: (s, MiB), at most 40.
        "curve": [
            (round(s[0], 1), round(s[1] / 2**20, 1)) for s in samples[:: max(1, len(samples) // 40)]
        ],
    }
