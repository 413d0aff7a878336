"""`make bench-serve`: the service under load on 127.0.0.1, side by side, in one run.

Every server is started on a free port and loaded by wrk (C, one thread, keep-alive); each
request is one image as a multipart ``image`` upload to ``/classify``. In one run:

1. throughput, Fashion CNN (models/model.onnx): the service with ``serve.workers: 1``,
   batching off, vs the bare Starlette + ONNX Runtime reference server with 1 worker, at
   1, 16 and 64 clients after a warm-up;
2. latency: the service with ``workers: cpu_count``, batching off, at 16 clients (p99),
   and the reference server with as many workers;
3. cold start: ``bentoml serve serving.service:ImageClassifier`` with params.yaml as it
   is (what ``make serve`` runs) until /readyz answers 200, then req/s in the first
   seconds after ready (no warm-up) against the warm req/s of the same server;
4. adaptive batching on and off, 1 worker, 16 and 64 clients, on the Fashion CNN and on a
   larger model: a randomly initialised RGB resnet18 at 160x160 px, built and exported to
   ONNX by this script with the pipeline's own code, loaded with real RGB JPEG photos of
   mixed sizes (320x240 to 640x480); plus ONNX Runtime alone at batch 1/8/32 for both
   models (the service's session options) and the decode time of their uploads: what
   batching can and cannot save.

About 3 minutes with the defaults on 2 cores, 7 server starts (``--quick``: about 70 s,
a smoke run whose figures mean little).
Writes reports/bench-serve.json and replaces the "## Serving" section of
docs/benchmarks.md (other sections are left as they are); ``--render`` rewrites that
section from the JSON alone.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Serving"
LEVELS = (1, 16, 64)  # throughput: wrk connections
BATCH_LEVELS = (16, 64)  # batching on/off
LATENCY_CLIENTS = 16  # latency, cold start and the throughput ratio
TOP = max(LEVELS)
ORT_BATCHES = (1, 8, 32)
FASHION, LARGE = "fashion", "resnet18"
LARGE_SIZE = 160
LARGE_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BOUNDARY = "trainyardbench"
# The targets of the serving issue. ``op`` compares the measured value with ``limit``.
TARGETS: dict[str, dict[str, Any]] = {
    "throughput": {
        "text": ">= 0.5x of reference: service (1 worker, batching off) / reference "
        f"(1 worker), req/s at {LATENCY_CLIENTS} clients",
        "op": ">=",
        "limit": 0.5,
        "unit": "x",
    },
    "latency": {
        "text": f"p99 <= 50 ms: service, workers cpu_count, batching off, {LATENCY_CLIENTS} "
        "clients",
        "op": "<=",
        "limit": 50.0,
        "unit": " ms",
    },
    "cold_start": {
        "text": "first 5 s not at half speed: req/s in the first seconds after ready / "
        f"warm req/s, same server, {LATENCY_CLIENTS} clients",
        "op": ">=",
        "limit": 0.5,
        "unit": "x",
    },
    "batching": {
        "text": f"batching on beats off at {TOP} clients on the larger model ({LARGE}): "
        "2xx req/s on / off",
        "op": ">",
        "limit": 1.0,
        "unit": "x",
    },
}

WRK_SCRIPT = """
local paths = {%(paths)s}
local requests = {}
local n = 0
init = function(args)
  for i, path in ipairs(paths) do
    local f = assert(io.open(path, "rb"))
    local body = f:read("*all")
    f:close()
    requests[i] = wrk.format("POST", "/classify",
      {["Content-Type"] = "multipart/form-data; boundary=%(boundary)s"}, body)
  end
end
request = function()
  n = n + 1
  return requests[(n %% #requests) + 1]
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, ' ..
    '"status_errors": %%d, "socket_errors": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end
"""


# ---------------------------------------------------------------------------- request bodies


def test_images(count: int) -> np.ndarray:
    """Real test images [N,C,H,W]: the prepared split if `make run` made it, else the raw
    Fashion-MNIST files."""
    prepared = REPO / "data/prepared/test_images.npy"
    if prepared.is_file():
        return np.array(np.load(prepared, mmap_mode="r")[:count])
    from trainyard.data.idx import read_idx

    raw = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
    return read_idx(raw)[:count, None]


def png_images(images: np.ndarray) -> list[bytes]:
    from PIL import Image

    out = []
    for img in images:
        buf = io.BytesIO()
        # [C,H,W] -> what PIL takes: [H,W] (grayscale) or [H,W,C]
        Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(
            buf, format="PNG"
        )
        out.append(buf.getvalue())
    return out


def photo_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """RGB JPEG "photos" of mixed sizes, 320x240 to 640x480: a smooth colour field, a few
    shapes and sensor-like noise, so they compress (and decode) like camera pictures."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w, h = int(rng.integers(320, 641)), int(rng.integers(240, 481))
        field = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
        im = Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC)
        draw = ImageDraw.Draw(im)
        for _ in range(int(rng.integers(2, 6))):
            x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
            x1, y1 = x0 + int(rng.integers(30, w // 2)), y0 + int(rng.integers(30, h // 2))
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), colour)
        noisy = np.asarray(im, dtype=np.float32) + rng.normal(0, 6, (h, w, 3))
        buf = io.BytesIO()
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def multipart_body(data: bytes, name: str, content_type: str) -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="{name}"\r\nContent-Type: {content_type}\r\n\r\n'
    )
    return head.encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()


def wrk_script(images: Sequence[bytes], content_type: str, folder: Path, name: str) -> Path:
    """A wrk Lua script that cycles through ``images``, one multipart upload each."""
    ext = content_type.split("/")[1]
    paths = []
    for i, data in enumerate(images):
        path = folder / f"{name}-body{i}.bin"
        path.write_bytes(multipart_body(data, f"{i}.{ext}", content_type))
        paths.append(json.dumps(str(path)))
    script = folder / f"{name}.lua"
    script.write_text(WRK_SCRIPT % {"paths": ", ".join(paths), "boundary": BOUNDARY})
    return script


# ---------------------------------------------------------------------------- the larger model


def build_large_model(path: Path, opset: int) -> None:
    """A randomly initialised resnet18 for 3x160x160 RGB ("crop" resize, 10 classes),
    exported as the pipeline exports (its dataset card and provenance in the metadata),
    with the ``<model>.sha256`` the service checks. Random weights: only speed is
    measured. Run in a child process (``--build-large``) so torch stays out of this one."""
    import torch

    from trainyard.core.card import Card
    from trainyard.core.io import atomic_write_text, sha256_file
    from trainyard.export.onnx_export import export_onnx, model_metadata
    from trainyard.model.classifier import Classifier

    torch.manual_seed(0)
    card = Card(
        source="folder",
        classes=LARGE_CLASSES,
        channels=3,
        height=LARGE_SIZE,
        width=LARGE_SIZE,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        resize="crop",
    )
    model = Classifier(card=card.contract(), arch=LARGE).eval()
    export_onnx(model, path, opset, model_metadata(model, "random-init", "", ""))
    atomic_write_text(path.with_name(path.name + ".sha256"), f"{sha256_file(path)}  {path.name}\n")


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except OSError:
        return 0, ""


def server_command(reference: bool, workers: int, port: int) -> list[str]:
    bindir = Path(sys.executable).parent
    if reference:
        cmd = [
            str(bindir / "uvicorn"),
            "benchmarks.reference_server:app",
            "--workers",
            str(workers),
        ]
        cmd += ["--no-access-log", "--log-level", "warning"]
    else:
        cmd = [str(bindir / "bentoml"), "serve", "serving.service:ImageClassifier"]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port)]


def start_server(
    params: Path, model: Path, log: Path, *, reference: bool = False, workers: int = 1
) -> tuple[subprocess.Popen, str, float]:
    """`bentoml serve` the service, or (``reference``) uvicorn the bare Starlette server
    with ``workers`` processes; (process, URL, seconds from start until /readyz is 200)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("TRAINYARD_API_KEY", None)
    threads = yaml.safe_load(params.read_text())["serve"].get("intra_op_threads", "auto")
    threads = 1 if threads == "auto" else threads  # the reference never batches: 1, as auto
    env.update(
        TRAINYARD_PARAMS=str(params),
        TRAINYARD_MODEL=str(model),
        TRAINYARD_ORT_THREADS=str(threads),  # the reference server's session option
        BENTOML_DO_NOT_TRACK="true",
    )
    cmd = server_command(reference, workers, port)
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = start + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{shlex.join(cmd)} exited:\n{log.read_text()[-3000:]}")
        if http_get(f"{url}/readyz", 1.0)[0] == 200:
            return proc, url, time.monotonic() - start
        time.sleep(0.05)
    stop_server(proc)
    raise SystemExit(f"{shlex.join(cmd)} not ready in 120 s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """From the service's /metrics: the batch-size histogram's sum and count (mean batch =
    sum / count) and the requests it refused with 503 because the adaptive batcher could
    not answer them within serve.max_latency_ms (``overloaded``). Summed over workers."""
    out = {"batch_sum": 0.0, "batch_count": 0.0, "shed": 0.0}
    for line in text.splitlines():
        if line.startswith("trainyard_batch_size_sum"):
            out["batch_sum"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("trainyard_batch_size_count"):
            out["batch_count"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("trainyard_requests_refused_total") and 'reason="overloaded"' in line:
            out["shed"] += float(line.rsplit(" ", 1)[1])
    return out


def wrk(url: str, script: Path, clients: int, seconds: int) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, int(seconds))}s", "--timeout", "10s"]
    cmd += ["-s", str(script), f"{url}/classify"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    line = next((x for x in out.splitlines() if x.startswith("WRKJSON ")), None)
    if line is None:
        raise SystemExit(f"wrk gave no summary:\n{out}")
    r = json.loads(line.removeprefix("WRKJSON "))
    seconds_run = max(r["duration_us"] / 1e6, 1e-9)
    ok = r["requests"] - r["status_errors"]
    return {
        "clients": clients,
        "seconds": round(seconds_run, 3),
        "requests": r["requests"],
        "req_per_s": r["requests"] / seconds_run,
        "ok_per_s": ok / seconds_run,  # 2xx answers only: what the ratios compare
        "p50_ms": r["p50_us"] / 1000,
        "p99_ms": r["p99_us"] / 1000,
        "non_2xx": r["status_errors"],
        "socket_errors": r["socket_errors"],
    }


def measure(url: str, script: Path, clients: int, seconds: int, service: bool) -> dict:
    """One wrk run; for the service also the mean batch and the 503s it shed meanwhile."""
    before = parse_metrics(http_get(f"{url}/metrics", 5.0)[1]) if service else None
    row = wrk(url, script, clients, seconds)
    row["mean_batch"] = row["shed"] = None
    if before is not None:
        after = parse_metrics(http_get(f"{url}/metrics", 5.0)[1])
        calls = after["batch_count"] - before["batch_count"]
        row["mean_batch"] = (after["batch_sum"] - before["batch_sum"]) / calls if calls else None
        row["shed"] = int(after["shed"] - before["shed"])
    return row


def describe(row: dict[str, Any]) -> str:
    batching = {True: "on", False: "off", None: "-"}[row["batching"]]
    name = "service" if row["server"] == "service" else "reference"
    extra = f"  mean batch {row['mean_batch']:.1f}" if row.get("mean_batch") else ""
    shed = f"  503 shed {row['shed']}" if row.get("shed") else ""
    return (
        f"  {row['model']:8s} {name:9s} w{row['workers']} batching {batching:3s} "
        f"{row['phase']:5s} {row['clients']:>3} clients: {row['ok_per_s']:7.1f} 2xx/s  "
        f"p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
        f"non-2xx {row['non_2xx']}  socket errors {row['socket_errors']}{extra}{shed}"
    )


class Bench:
    """Starts each server configuration and runs wrk against it."""

    def __init__(self, tmp: Path, seconds: int, warmup: int, first_seconds: int) -> None:
        self.tmp, self.seconds, self.warmup = tmp, seconds, warmup
        self.first_seconds = first_seconds
        self.base = yaml.safe_load((REPO / "params.yaml").read_text())
        self.rows: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.cold: dict[str, Any] = {}

    def params(self, name: str, **serve: Any) -> Path:
        raw = json.loads(json.dumps(self.base))
        # Room for 64 clients, so only the service is measured, not its 429s.
        serve.setdefault("max_concurrency", max(raw["serve"]["max_concurrency"], 256))
        raw["serve"].update(serve)
        path = self.tmp / f"params-{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def _record(self, row: dict[str, Any], ident: dict[str, Any], phase: str) -> None:
        row.update(ident, phase=phase)
        if phase == "first":
            row["section"] = "cold"
        self.rows.append(row)
        print(describe(row), flush=True)

    def run(
        self,
        section: str,
        *,
        model_name: str,
        model: Path,
        script: Path,
        levels: Iterable[int],
        reference: bool = False,
        workers: int | str = 1,
        batching: bool = False,
        params: Path | None = None,
        first: bool = False,
    ) -> None:
        """Start one server, optionally load it for ``first_seconds`` at once (cold start),
        warm it up, then wrk at each level; stop it."""
        n_workers = (os.cpu_count() or 1) if workers == "cpu_count" else int(workers)
        kind = "reference" if reference else "batching-" + ("on" if batching else "off")
        name = f"{len(self.servers) + 1}-{model_name}-w{n_workers}-{kind}"
        if params is None:
            params = self.params(name, workers=workers, batching=batching)
        ident = {
            "run": name,
            "section": section,
            "model": model_name,
            "server": "reference" if reference else "service",
            "workers": n_workers,
            "batching": None if reference else batching,
        }
        overrides = "" if reference else f"serve.workers={workers} serve.batching={batching}"
        print(f"{name}: starting", flush=True)
        log = self.tmp / f"{name}.log"
        proc, url, ready_s = start_server(
            params, model, log, reference=reference, workers=n_workers
        )
        self.servers.append({**ident, "ready_s": round(ready_s, 2), "overrides": overrides})
        print(f"  ready in {ready_s:.1f} s", flush=True)
        try:
            if first:
                row = measure(url, script, LATENCY_CLIENTS, self.first_seconds, not reference)
                self._record(row, ident, "first")
                self.cold = {**ident, "ready_s": ready_s, "params": "params.yaml"}
                self.cold.pop("section")
            wrk(url, script, LATENCY_CLIENTS, self.warmup)  # trains the batcher, warms caches
            for clients in levels:
                row = measure(url, script, clients, self.seconds, not reference)
                self._record(row, ident, "warm")
        finally:
            stop_server(proc)
        if any(r["non_2xx"] or r["socket_errors"] for r in self.rows if r["run"] == name):
            # What the server said about it (tracebacks, warnings), for the report.
            said = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            noted = [x for x in said if any(w in x for w in ("ERROR", "Error", "WARNING"))]
            for line in (noted or said)[-15:]:
                print(f"  log: {line[:300]}", flush=True)


# ---------------------------------------------------------------------------- in process


def ort_rate(session: Any, x: np.ndarray, seconds: float, callers: int = 1) -> dict[str, Any]:
    """img/s of ``session`` on batch ``x`` from ``callers`` threads calling it at once (ONNX
    Runtime releases the GIL), as the service's thread pool does with batching off."""
    import threading

    for _ in range(2):
        session.run(x)
    calls = [0] * callers
    start = time.perf_counter()

    def loop(i: int) -> None:
        while calls[i] < 3 or time.perf_counter() - start < seconds:
            session.run(x)
            calls[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    batch = x.shape[0]
    return {
        "batch": batch,
        "callers": callers,
        "img_per_s": batch * sum(calls) / took,
        "ms_per_batch": took * 1000 * callers / sum(calls),  # one call's time
        "ms_per_image": took * 1000 / (batch * sum(calls)),  # wall time per image
    }


def raw_onnx(
    model: Path, device: str, threads: int, seconds: float, batches: Sequence[int] = ORT_BATCHES
) -> tuple[list[dict[str, Any]], str]:
    """ONNX Runtime alone, in process: the service's session options at each batch size,
    one call at a time (what BentoML's batcher does: one batch in flight per worker); batch
    1 from one thread per core at once (what the thread pool does with batching off); and
    the largest batch with one intra-op thread per core (``serve.intra_op_threads: 0``)."""
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.sessions import load_onnx

    session = load_onnx(model, device=device, intra_op_threads=threads)  # type: ignore[arg-type]
    shape = card_from_metadata(session.metadata, str(model)).input_shape
    rng = np.random.default_rng(0)
    cores = os.cpu_count() or 1
    plan = [(session, threads, b, 1) for b in batches] + [(session, threads, 1, cores)]
    if threads != 0 and device != "cuda":
        every_core = load_onnx(model, device=device, intra_op_threads=0)  # type: ignore[arg-type]
        plan.append((every_core, 0, max(batches), 1))
    rows = []
    for sess, n_threads, batch, callers in plan:
        x = rng.standard_normal((batch, *shape), dtype=np.float32)
        row = {"threads": n_threads, **ort_rate(sess, x, seconds, callers)}
        rows.append(row)
        print(
            f"  ONNX Runtime {model.name} batch {batch:>3}, {n_threads or 'all'} intra-op "
            f"thread(s), {callers} caller(s): {row['img_per_s']:8.0f} img/s, "
            f"{row['ms_per_image']:.3f} ms per image",
            flush=True,
        )
    return rows, session.provider


def decode_ms(model: Path, images: Sequence[bytes], seconds: float) -> float:
    """Milliseconds to decode and resize one upload for ``model`` (trainyard.runtime.inputs,
    as the service does), averaged over ``images``."""
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.inputs import decode_image
    from trainyard.runtime.sessions import load_onnx

    card = card_from_metadata(load_onnx(model, device="cpu", intra_op_threads=1).metadata)
    done, start = 0, time.perf_counter()
    while done < len(images) or time.perf_counter() - start < seconds:
        decode_image(images[done % len(images)], card)
        done += 1
    return (time.perf_counter() - start) * 1000 / done


# ---------------------------------------------------------------------------- figures


def pick(rows: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The first row whose fields equal ``match`` (``phase`` defaults to "warm")."""
    match.setdefault("phase", "warm")
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    """2xx req/s of ``num`` / ``den``; None if either is missing or ``den`` served none."""
    if num is None or den is None or not den["ok_per_s"]:
        return None
    return num["ok_per_s"] / den["ok_per_s"]


def met(key: str, value: float | None) -> bool | None:
    if value is None:
        return None
    t = TARGETS[key]
    return {">=": value >= t["limit"], "<=": value <= t["limit"], ">": value > t["limit"]}[t["op"]]


def batching_pair(
    rows: Iterable[dict[str, Any]], model: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(batching on, off) rows of ``model``: the service, 1 worker, warm; for the Fashion
    CNN the "off" rows are the throughput run's."""
    on, off = [], []
    for r in rows:
        if (
            r["model"] == model
            and r["server"] == "service"
            and r["workers"] == 1
            and r["phase"] == "warm"
            and r["section"] in ("throughput", "batching")
            and r["clients"] in BATCH_LEVELS
        ):
            (on if r["batching"] else off).append(r)
    return on, off


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the serving issue asks for, and each target's verdict."""
    rows, cores = result["rows"], result["machine"]["cores"]
    out: dict[str, Any] = {}
    svc1 = {"section": "throughput", "server": "service"}
    ref1 = {"section": "throughput", "server": "reference"}
    out["throughput"] = {
        c: ratio(pick(rows, **svc1, clients=c), pick(rows, **ref1, clients=c)) for c in LEVELS
    }
    lat = pick(rows, section="latency", server="service", workers=cores, batching=False)
    out["latency_p99_ms"] = lat["p99_ms"] if lat else None
    cold = result.get("cold_start") or {}
    first = pick(rows, phase="first")
    warm = pick(rows, run=cold.get("run"))
    out["cold_ready_s"] = cold.get("ready_s")
    out["cold_ratio"] = ratio(first, warm) if first else None
    out["batching"] = {}
    for model in (FASHION, LARGE):
        on, off = batching_pair(rows, model)
        out["batching"][model] = {
            c: ratio(pick(on, clients=c), pick(off, clients=c)) for c in BATCH_LEVELS
        }
    values = {
        "throughput": out["throughput"][LATENCY_CLIENTS],
        "latency": out["latency_p99_ms"],
        "cold_start": out["cold_ratio"],
        "batching": out["batching"][LARGE][TOP],
    }
    out["targets"] = {
        k: {"value": v, "met": met(k, v), "text": TARGETS[k]["text"]} for k, v in values.items()
    }
    service_rows = [r for r in rows if r["server"] == "service"]
    out["non_2xx"] = sum(r["non_2xx"] for r in service_rows)
    out["socket_errors"] = sum(r["socket_errors"] for r in rows)
    out["shed"] = sum(r["shed"] or 0 for r in service_rows)
    return out


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def _verdict(ok: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[ok]


def _row_cells(r: dict[str, Any]) -> str:
    batching = {True: "on", False: "off", None: "–"}[r["batching"]]
    server = "BentoML service" if r["server"] == "service" else "Starlette + ORT reference"
    mean = _num(r.get("mean_batch"), ".1f") if r.get("mean_batch") else "–"
    shed = "–" if r.get("shed") is None else str(r["shed"])
    return (
        f"| {server} | {r['workers']} | {batching} | {r['clients']} | {r['req_per_s']:.0f} | "
        f"{r['ok_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['non_2xx']} | "
        f"{r['socket_errors']} | {shed} | {mean} |"
    )


TABLE_HEAD = [
    "| server | workers | batching | clients | req/s | 2xx/s | p50 ms | p99 ms | non-2xx "
    "| socket errors | 503 shed | mean batch |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _table(rows: Iterable[dict[str, Any]]) -> list[str]:
    return [*TABLE_HEAD, *(_row_cells(r) for r in rows)]


def ort_rows(
    result: dict[str, Any], model: str, callers: int = 1, threads: int | None = None
) -> list[dict[str, Any]]:
    """ONNX Runtime rows of ``model`` with ``callers`` threads calling at once and
    ``threads`` intra-op threads (default: the service's)."""
    want = result["threads"] if threads is None else threads
    return [
        r
        for r in result["onnx_runtime"].get(model) or []
        if r.get("callers", 1) == callers and r.get("threads", result["threads"]) == want
    ]


def ort_story(result: dict[str, Any], model: str) -> str:
    """Why batching wins or not, in ONNX Runtime's own figures: the batcher runs one call
    at a time, the thread pool without batching runs several."""
    single = ort_rows(result, model)
    if not single:
        return ""
    cores, threads = result["machine"]["cores"], result["threads"]
    best = max(single, key=lambda r: r["img_per_s"])
    text = (
        f"With `serve.intra_op_threads` = {threads}, ONNX Runtime gains "
        f"{best['img_per_s'] / single[0]['img_per_s']:.2f}x img/s from batch 1 to batch "
        f"{best['batch']} ({single[0]['img_per_s']:.0f} -> {best['img_per_s']:.0f} img/s), "
        "and with batching on a worker runs one ONNX Runtime call at a time"
    )
    together = ort_rows(result, model, callers=cores)
    if together:
        text += (
            f"; with batching off its thread pool runs calls side by side: batch 1 from "
            f"{cores} threads at once gives {together[0]['img_per_s']:.0f} img/s"
        )
    wide = ort_rows(result, model, threads=0)
    if wide:
        text += (
            f". Batch {wide[0]['batch']} with one intra-op thread per core "
            f"(`serve.intra_op_threads: 0`) gives {wide[0]['img_per_s']:.0f} img/s"
        )
    return text + ". Decoding and HTTP work stay per request either way."


def why_batching(result: dict[str, Any], model: str, rows: list[dict[str, Any]]) -> str:
    """What batching can save for ``model``, from ONNX Runtime alone and the decode time."""
    ort = ort_rows(result, model)
    on_rows, off_rows = batching_pair(rows, model)
    on, off = pick(on_rows, clients=TOP), pick(off_rows, clients=TOP)
    if not ort or off is None or not off["ok_per_s"]:
        return ""
    one = ort[0]
    best = min(ort, key=lambda r: r["ms_per_image"])
    per_request = 1000 / off["ok_per_s"]
    saving = one["ms_per_image"] - best["ms_per_image"]
    decode = result.get("decode_ms", {}).get(model)
    text = (
        f"{model}: with batching off, 1 worker answers a request every {per_request:.2f} ms "
        f"at {TOP} clients. ONNX Runtime alone takes {one['ms_per_image']:.2f} ms per image "
        f"at batch 1 and {best['ms_per_image']:.2f} ms at batch {best['batch']} "
        f"({best['img_per_s'] / one['img_per_s']:.2f}x img/s)"
    )
    if decode is not None:
        text += f"; decoding and resizing one upload takes {decode:.2f} ms, batched or not"
    text += (
        f". Merging requests saves at most {saving:.2f} ms of model time per image "
        f"({saving / per_request:.0%} of a request's {per_request:.2f} ms), plus the "
        "service's fixed work per ONNX Runtime call (a thread-pool hop, normalisation, "
        "softmax, metrics), done once per batch instead of once per request"
    )
    if on is not None:
        text += (
            f". Measured: **{_num(ratio(on, off), '.2f', 'x')}** 2xx req/s, mean batch "
            f"{_num(on.get('mean_batch'), '.1f')}, p99 {on['p99_ms']:.0f} ms with batching "
            f"on vs {off['p99_ms']:.0f} ms off"
        )
        if on.get("shed"):
            text += (
                f", {on['shed']} requests shed with 503 (the batcher's estimate of their "
                "latency passed `serve.max_latency_ms`)"
            )
    return text + "."


def markdown(result: dict[str, Any]) -> str:
    m, rows, s = result["machine"], result["rows"], summary(result)
    models = result["models"]
    fashion, large = models[FASHION], models[LARGE]
    lines = [
        SECTION,
        "",
        f"`{result['command']}` on {result['date']}: {m['cpu']}, {m['cores']} cores, load "
        f"average {m['loadavg']:.2f} at the start; ONNX Runtime on {result['provider']}, "
        f"`serve.intra_op_threads` = {result['threads']} (the reference server too)"
        + (
            f", `serve.access_log` = {str(result['access_log']).lower()} (the reference "
            "server logs no requests)"
            if result.get("access_log") is not None
            else ""
        )
        + ". wrk on "
        f"127.0.0.1 (one thread, keep-alive, 10 s timeout), {result['seconds']:g} s per level "
        f"after a {result['warmup']:g} s warm-up at {LATENCY_CLIENTS} clients; every request "
        "is one image as a multipart `image` upload to `/classify`. Each server is started "
        "fresh on a free port with params.yaml plus the overrides named (and "
        "`serve.max_concurrency` >= 256, so no 429s). 2xx/s counts successful answers only; "
        "every ratio below compares 2xx/s."
        + (f" The whole run took {result['wall_s']:.0f} s." if result.get("wall_s") else ""),
        "",
        f"- Fashion CNN: `models/model.onnx` ({fashion['sha256'][:12]}), input "
        f"{fashion['input']}; requests: {fashion['requests']}.",
        f"- Larger model: {large['description']}, input {large['input']}, "
        f"{large['size_mb']:.0f} MB, built and exported by the bench in "
        f"{large['build_s']:.0f} s; requests: {large['requests']}.",
        "",
        "### Targets",
        "",
        "| target | measured | verdict |",
        "|---|---:|---|",
    ]
    for key, t in s["targets"].items():
        unit = TARGETS[key]["unit"]
        fmt = ".0f" if key == "latency" else ".2f"
        lines.append(f"| {t['text']} | {_num(t['value'], fmt, unit)} | {_verdict(t['met'])} |")
    lines += [
        "",
        f"Across all runs the service answered {s['non_2xx']} requests with a non-2xx "
        f"status ({s['shed']} of them 503s shed by the adaptive batcher); wrk saw "
        f"{s['socket_errors']} socket errors (connect, read, write, timeout).",
        "",
        "### 1. Throughput: service vs reference, 1 worker, Fashion CNN",
        "",
        *_table(r for r in rows if r["section"] == "throughput"),
        "",
        "Service / reference, 2xx req/s: "
        + ", ".join(f"{c} clients {_num(v, '.2f', 'x')}" for c, v in s["throughput"].items())
        + ". The difference is BentoML's own per-request work (its ASGI stack, traffic "
        "limits and metrics, the service's guard and trace headers).",
        "",
        f"### 2. Latency: workers cpu_count ({m['cores']}), batching off, Fashion CNN",
        "",
        *_table(r for r in rows if r["section"] == "latency"),
        "",
        f"{LATENCY_CLIENTS} closed-loop clients queue behind each other: by Little's law the "
        f"mean latency is about {LATENCY_CLIENTS} / req/s, so p99 <= 50 ms needs well over "
        f"{LATENCY_CLIENTS / 0.05:.0f} req/s.",
        "",
    ]
    cold = result.get("cold_start")
    first = pick(rows, phase="first")
    if cold and first:
        warm = pick(rows, run=cold.get("run"))
        lines += [
            "### 3. Cold start: `make serve`'s configuration (params.yaml as it is)",
            "",
            f"`bentoml serve serving.service:ImageClassifier` with `serve.workers` = "
            f"{cold.get('workers_param', cold['workers'])} ({cold['workers']} processes), batching "
            f"{'on' if cold['batching'] else 'off'}: **{cold['ready_s']:.1f} s** from the "
            "command's start until `/readyz` answered 200 (polled every 50 ms; Python's "
            "files were already in the page cache from the servers started before). Then, "
            f"with no warm-up, wrk for the first {result['first_seconds']:g} s, and after a "
            f"warm-up the same server warm, {LATENCY_CLIENTS} clients each:",
            "",
            *TABLE_HEAD,
            _row_cells(first).replace("| BentoML service |", "| BentoML service, first s |"),
            *([_row_cells(warm).replace("| BentoML service |", "| same, warm |")] if warm else []),
            "",
            f"First {result['first_seconds']:g} s / warm, 2xx req/s: "
            f"**{_num(s['cold_ratio'], '.2f', 'x')}**.",
            "",
        ]
    lines += [
        "### 4. Adaptive batching, 1 worker: Fashion CNN and resnet18",
        "",
    ]
    for model, title in ((FASHION, "Fashion CNN"), (LARGE, f"{LARGE} {large['input']}")):
        batching_rows = [r for pair in batching_pair(rows, model) for r in pair]
        batching_rows.sort(key=lambda r: (r["clients"], not r["batching"]))
        ratios = s["batching"][model]
        lines += [
            f"{title}:",
            "",
            *_table(batching_rows),
            "",
            "Batching on / off, 2xx req/s: "
            + ", ".join(f"{c} clients **{_num(v, '.2f', 'x')}**" for c, v in ratios.items())
            + ".",
            "",
        ]
    lines += [
        "ONNX Runtime alone, in process, no HTTP, no decode: the service's session options "
        "one call at a time (with batching on, BentoML's batcher runs one batch at a time "
        f"per worker), batch 1 from {m['cores']} threads at once (with batching off the "
        "thread pool runs several requests' calls at once), and the largest batch with one "
        "intra-op thread per core (`serve.intra_op_threads: 0`). ms per image = wall time / "
        "images.",
        "",
        "| model | batch | intra-op threads | calls at once | img/s | ms per call | ms per image |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in (FASHION, LARGE):
        for r in result["onnx_runtime"].get(model, []):
            threads = r.get("threads", result["threads"])
            lines.append(
                f"| {model} | {r['batch']} | {threads or 'one per core'} | "
                f"{r.get('callers', 1)} | {r['img_per_s']:.0f} | {r['ms_per_batch']:.2f} | "
                f"{r['ms_per_image']:.3f} |"
            )
    lines.append("")
    lines += [f"- {t}" for t in (why_batching(result, x, rows) for x in (FASHION, LARGE)) if t]
    won = s["targets"]["batching"]["met"]
    if won is not None:
        verdict = "won" if won else "did not win"
        lines += ["", f"Batching {verdict} on {LARGE} here. " + ort_story(result, LARGE)]
    lines.append("")
    return "\n".join(lines)


def replace_section(doc: Path, section: str, heading: str = SECTION) -> None:
    """Put ``section`` in place of the existing ``heading`` section (or at the end).
    The section ends at the next "## " heading or marked block (``<!-- bench:...``), so
    other benchmarks' sections and markers are left as they are."""
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    start = text.find(f"\n{heading}\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        body = start + len(heading) + 2
        ends = [i for i in (text.find("\n## ", body), text.find("\n<!-- bench:", body)) if i != -1]
        tail = "\n" + text[min(ends) :].lstrip("\n") if ends else ""
        text = text[: start + 1] + section.rstrip("\n") + "\n" + tail
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def print_summary(result: dict[str, Any]) -> None:
    s, rows = summary(result), result["rows"]
    print("\nSummary")
    for c, v in s["throughput"].items():
        svc = pick(rows, section="throughput", server="service", clients=c)
        ref = pick(rows, section="throughput", server="reference", clients=c)
        lat = "".join(
            f"; {n} p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms"
            for n, r in (("service", svc), ("reference", ref))
            if r
        )
        print(f"  service / reference, 1 worker, {c:>2} clients: {_num(v, '.2f', 'x')}{lat}")
    for key, t in s["targets"].items():
        unit = TARGETS[key]["unit"]
        value = _num(t["value"], ".0f" if key == "latency" else ".2f", unit)
        print(f"  {t['text']}: {value} -> {_verdict(t['met']).strip('*')}")
    for model, ratios in s["batching"].items():
        text = ", ".join(f"{c} clients {_num(v, '.2f', 'x')}" for c, v in ratios.items())
        print(f"  batching on / off, {model}: {text}")
    print(f"  cold start: ready in {_num(s['cold_ready_s'], '.1f', ' s')}")
    print(
        f"  service non-2xx: {s['non_2xx']} (503 shed: {s['shed']}); "
        f"socket errors: {s['socket_errors']}"
    )


# ---------------------------------------------------------------------------- main


def preflight(name: str, script: str, argv: Sequence[str]) -> tuple[Any, str] | None:
    """What a load test needs before it starts: wrk, and the exported model with its
    .sha256 (the service refuses to start without both). None after saying what is missing;
    else (the serve settings, the command line to record), with the repository as cwd."""
    if shutil.which("wrk") is None:
        print(f"{name} needs wrk: apt-get install wrk", file=sys.stderr)
        return None
    model = REPO / "models/model.onnx"
    if not model.is_file() or not model.with_name("model.onnx.sha256").is_file():
        print(f"{model} (and its .sha256) not found: run `make run` first", file=sys.stderr)
        return None
    os.chdir(REPO)
    from trainyard.core.config import load_params

    python = Path(sys.executable)
    shown = python.relative_to(REPO) if python.is_relative_to(REPO) else python
    return load_params(REPO / "params.yaml").serve, shlex.join([str(shown), script, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Whole seconds: wrk's -d takes nothing finer.
    p.add_argument("--seconds", type=int, default=6, help="load per concurrency level, s")
    p.add_argument("--warmup", type=int, default=3, help="load before measuring, s")
    p.add_argument(
        "--first-seconds", type=int, default=5, help="cold start: load right after ready, s"
    )
    p.add_argument("--ort-seconds", type=float, default=1.5, help="ONNX Runtime, per batch")
    p.add_argument("--images", type=int, default=32, help="distinct images sent per model")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 2 s per level, 1 s warm-up, 8 images"
    )
    p.add_argument("--docs", default=str(REPO / "docs/benchmarks.md"))
    p.add_argument("--json", default=str(REPO / "reports/bench-serve.json"))
    p.add_argument("--render", action="store_true", help="only rewrite the docs from --json")
    p.add_argument("--build-large", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build_large:
        from trainyard.core.config import load_params

        build_large_model(Path(args.build_large), load_params(REPO / "params.yaml").export.opset)
        return 0
    if args.render:
        result = json.loads(Path(args.json).read_text())
        replace_section(Path(args.docs), markdown(result))
        print_summary(result)
        return 0
    if args.quick:
        args.seconds, args.warmup, args.first_seconds = 2, 1, 2
        args.ort_seconds, args.images = 0.3, 8
    ready = preflight("bench-serve", "benchmarks/bench_serve.py", argv)
    if ready is None:
        return 2
    settings, command = ready
    fashion = REPO / "models/model.onnx"
    from trainyard.core.host import cpu_name
    from trainyard.core.io import atomic_write_json, sha256_file

    loadavg = os.getloadavg()[0]
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        large = tmp / f"{LARGE}-{LARGE_SIZE}.onnx"
        print(f"building {large.name} (random init) and exporting it to ONNX", flush=True)
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, __file__, "--build-large", str(large)], cwd=REPO, check=True
        )
        build_s = time.monotonic() - t0
        pngs = png_images(test_images(args.images))
        photos = photo_jpegs(args.images)
        fashion_script = wrk_script(pngs, "image/png", tmp, FASHION)
        large_script = wrk_script(photos, "image/jpeg", tmp, LARGE)
        bench = Bench(tmp, args.seconds, args.warmup, args.first_seconds)
        common = {"model_name": FASHION, "model": fashion, "script": fashion_script}

        print("1. throughput, 1 worker", flush=True)
        bench.run("throughput", **common, levels=LEVELS)
        bench.run("throughput", **common, levels=LEVELS, reference=True)

        print("3. cold start (params.yaml as it is), 2. latency (workers cpu_count)", flush=True)
        default_workers, default_batching = settings.workers, settings.batching
        n_default = (os.cpu_count() or 1) if default_workers == "cpu_count" else default_workers
        # make serve's configuration is usually the latency one: then one server does both.
        same = n_default == os.cpu_count() and not default_batching
        bench.run(
            "latency" if same else "cold",
            **common,
            levels=(LATENCY_CLIENTS,),
            workers=default_workers,
            batching=default_batching,
            params=REPO / "params.yaml",
            first=True,
        )
        bench.cold["workers_param"] = default_workers
        if not same:
            bench.run("latency", **common, levels=(LATENCY_CLIENTS,), workers="cpu_count")
        bench.run(
            "latency", **common, levels=(LATENCY_CLIENTS,), workers="cpu_count", reference=True
        )

        print("4. adaptive batching, 1 worker", flush=True)
        bench.run("batching", **common, levels=BATCH_LEVELS, batching=True)
        for batching in (False, True):
            bench.run(
                "batching",
                model_name=LARGE,
                model=large,
                script=large_script,
                levels=BATCH_LEVELS,
                batching=batching,
            )

        print("ONNX Runtime alone, and the decode of one upload", flush=True)
        ort, decode, provider = {}, {}, ""
        for name, path, images in ((FASHION, fashion, pngs), (LARGE, large, photos)):
            ort[name], provider = raw_onnx(
                path, settings.device, settings.model_threads(), args.ort_seconds
            )
            decode[name] = decode_ms(path, images, args.ort_seconds)
            print(f"  decode + resize, {name}: {decode[name]:.3f} ms per image", flush=True)
        large_mb = large.stat().st_size / 1e6
        large_sha = sha256_file(large)

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "loadavg": loadavg},
        "provider": provider,
        "threads": settings.model_threads(),
        "access_log": getattr(settings, "access_log", None),
        "seconds": args.seconds,
        "warmup": args.warmup,
        "first_seconds": args.first_seconds,
        "wall_s": round(time.monotonic() - began, 1),
        "models": {
            FASHION: {
                "path": "models/model.onnx",
                "sha256": sha256_file(fashion),
                "input": "1x28x28",
                "requests": f"{args.images} Fashion-MNIST test images as PNG (28x28 grey)",
            },
            LARGE: {
                "description": f"torchvision {LARGE} through trainyard.model.classifier."
                "Classifier, random initialisation (speed only, no training), exported with "
                "trainyard.export.onnx_export (dataset card and metadata as the pipeline "
                "writes them)",
                "sha256": large_sha,
                "input": f"3x{LARGE_SIZE}x{LARGE_SIZE} (resize crop, {len(LARGE_CLASSES)} classes)",
                "size_mb": large_mb,
                "build_s": build_s,
                "requests": f"{args.images} generated RGB JPEG photos (quality 85), "
                "320x240 to 640x480 px",
            },
        },
        "servers": bench.servers,
        "cold_start": bench.cold,
        "rows": bench.rows,
        "onnx_runtime": ort,
        "decode_ms": decode,
    }
    result["summary"] = summary(result)
    atomic_write_json(args.json, result)
    replace_section(Path(args.docs), markdown(result))
    print_summary(result)
    print(f"wrote {args.json} and the '{SECTION}' section of {args.docs} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
