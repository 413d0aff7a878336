"""`make bench-serve`'s load: the request bodies, the servers (started on a free port,
stopped by process group) and wrk against them, one row per level. `make soak` shares
the bodies, the servers and the preflight."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.harness.procs import free_port
from benchmarks.serve_figures import LATENCY_CLIENTS

REPO = Path(__file__).resolve().parents[1]
BOUNDARY = "trainyardbench"

WRK_SCRIPT = """
local paths = {%(paths)s}
local requests = {}
local n = 0
init = function(args)
  for i, path in ipairs(paths) do
    local f = assert(io.open(path, "rb"))
    local body = f:read("*all")
    f:close()
    requests[i] = wrk.format("POST", "%(path)s",
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
    """Each [C,H,W] uint8 image of ``images`` as PNG bytes."""
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
    """``data`` as the one ``image`` part of a multipart/form-data body (``BOUNDARY``)."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="{name}"\r\nContent-Type: {content_type}\r\n\r\n'
    )
    return head.encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()


def wrk_script(
    images: Sequence[bytes], content_type: str, folder: Path, name: str, path: str = "/classify"
) -> Path:
    """A wrk Lua script that cycles through ``images``, one multipart upload each to
    ``path`` (with its query)."""
    ext = content_type.split("/")[1]
    paths = []
    for i, data in enumerate(images):
        body = folder / f"{name}-body{i}.bin"
        body.write_bytes(multipart_body(data, f"{i}.{ext}", content_type))
        paths.append(json.dumps(str(body)))
    script = folder / f"{name}.lua"
    fields = {"paths": ", ".join(paths), "boundary": BOUNDARY, "path": path}
    script.write_text(WRK_SCRIPT % fields)
    return script


# ---------------------------------------------------------------------------- servers


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except OSError:
        return 0, ""


BARE = ("reference", "inline")  # the bare Starlette servers (benchmarks/reference_server.py)
BENTOS = {  # the plain BentoML services (benchmarks/reference_bento.py)
    "bento-plain": "PlainClassifier",
    "bento-lean": "LeanClassifier",
}


def server_command(server: str, workers: int, port: int) -> list[str]:
    """The command line of ``server``: the service (``bentoml serve``), a bare server
    (uvicorn; ``reference`` hops to a thread per request, ``inline`` runs the model on its
    event loop) or a plain BentoML service (``BENTOS``, one worker)."""
    bindir = Path(sys.executable).parent
    if server in BARE:
        app = "benchmarks.reference_server:" + ("inline_app" if server == "inline" else "app")
        cmd = [str(bindir / "uvicorn"), app, "--workers", str(workers)]
        cmd += ["--no-access-log", "--log-level", "warning"]
    elif server in BENTOS:
        if workers != 1:
            raise ValueError(f"{server} is served by one worker, not {workers}")
        cmd = [str(bindir / "bentoml"), "serve", f"benchmarks.reference_bento:{BENTOS[server]}"]
    else:
        cmd = [str(bindir / "bentoml"), "serve", "bento.service:ImageClassifier"]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port)]


def start_server(
    params: Path,
    model: Path,
    log: Path,
    *,
    server: str = "service",
    workers: int = 1,
) -> tuple[subprocess.Popen, str, float]:
    """Start ``server`` (``server_command``: the service, a bare or a plain BentoML one)
    with ``workers`` processes; (process, URL, seconds from start until /readyz is 200)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("TRAINYARD_API_KEY", None)
    threads = yaml.safe_load(params.read_text())["serve"].get("intra_op_threads", "auto")
    threads = 1 if threads == "auto" else threads  # the references never batch: 1, as auto
    env.update(
        TRAINYARD_PARAMS=str(params),
        TRAINYARD_MODEL=str(model),
        TRAINYARD_ORT_THREADS=str(threads),  # the reference server's session option
        BENTOML_DO_NOT_TRACK="true",
    )
    cmd = server_command(server, workers, port)
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
    """SIGTERM the server's process group, SIGKILL it after 15 s."""
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


def wrk_summary(
    target: str, script: Path, clients: int, seconds: int, marker: str
) -> dict[str, Any]:
    """Run wrk on ``target`` with ``script`` at ``clients`` connections; return the JSON
    summary the script prints on the line that starts with ``marker``."""
    cmd = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, int(seconds))}s", "--timeout", "10s"]
    cmd += ["-s", str(script), target]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    line = next((x for x in out.splitlines() if x.startswith(f"{marker} ")), None)
    if line is None:
        raise SystemExit(f"wrk gave no summary:\n{out}")
    return json.loads(line.removeprefix(f"{marker} "))  # type: ignore[no-any-return]


def wrk(url: str, script: Path, clients: int, seconds: int) -> dict[str, Any]:
    """One wrk run of ``script`` at ``clients`` connections: its rates and latencies."""
    r = wrk_summary(f"{url}/classify", script, clients, seconds, "WRKJSON")
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
    """One measured row as a console line."""
    batching = {True: "on", False: "off", None: "-"}[row["batching"]]
    name = row["server"]  # service, reference (thread hop) or inline (bare, no hop)
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
        """params.yaml with ``serve`` overrides, written for the server ``name``."""
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
        server: str = "service",
        workers: int | str = 1,
        batching: bool = False,
        params: Path | None = None,
        first: bool = False,
        label: dict[str, Any] | None = None,
    ) -> None:
        """Start one server (``server_command``: the service, a bare server or a plain
        BentoML one), optionally load it for ``first_seconds`` at once (cold start), warm it
        up, then wrk at each level; stop it."""
        reference = server != "service"
        n_workers = (os.cpu_count() or 1) if workers == "cpu_count" else int(workers)
        kind = server if reference else "batching-" + ("on" if batching else "off")
        name = f"{len(self.servers) + 1}-{model_name}-w{n_workers}-{kind}"
        if params is None:
            params = self.params(name, workers=workers, batching=batching)
        ident = {
            "run": name,
            "section": section,
            "model": model_name,
            "server": server,
            "workers": n_workers,
            "batching": None if reference else batching,
            **(label or {}),
        }
        overrides = "" if reference else f"serve.workers={workers} serve.batching={batching}"
        print(f"{name}: starting", flush=True)
        log = self.tmp / f"{name}.log"
        proc, url, ready_s = start_server(params, model, log, server=server, workers=n_workers)
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
        self._echo_log(name, log)

    def _echo_log(self, name: str, log: Path) -> None:
        """Where run ``name`` had errors: what the server said about them (tracebacks,
        warnings; else its last lines), for the report."""
        if any(r["non_2xx"] or r["socket_errors"] for r in self.rows if r["run"] == name):
            said = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            noted = [x for x in said if any(w in x for w in ("ERROR", "Error", "WARNING"))]
            for line in (noted or said)[-15:]:
                print(f"  log: {line[:300]}", flush=True)


def preflight(name: str, module: str, argv: Sequence[str]) -> tuple[Any, str] | None:
    """What a load test needs before it starts: wrk, and the exported model with its
    .sha256 (the service refuses to start without both). None after saying what is missing;
    else (the serve settings, the command line to record: ``python -m <module> <argv>``),
    with the repository as cwd."""
    if shutil.which("wrk") is None:
        print(f"{name} needs wrk: apt-get install wrk", file=sys.stderr)
        return None
    model = REPO / "models/model.onnx"
    if not model.is_file() or not model.with_name("model.onnx.sha256").is_file():
        print(f"{model} (and its .sha256) not found: run `make run` first", file=sys.stderr)
        return None
    os.chdir(REPO)
    from trainyard.core.config import load_params
    from trainyard.serve.batch_choice import CHOICE_ENV, choose_path

    # serve.batching: auto, decided for the Fashion model as `make serve` decides it.
    path = choose_path(load_params(REPO / "params.yaml").serve, model)
    os.environ.pop(CHOICE_ENV, None)  # each server started here measures for itself
    print(f"{name}: /classify runs {path.describe()} ({path.why})")
    settings = path.params
    return settings, command_line(module, argv)


def command_line(module: str, argv: Sequence[str]) -> str:
    """``<python> -m <module> <argv>`` as typed, the python relative to the repository
    when it is the venv's: the command the docs section names."""
    python = Path(sys.executable)
    shown = python.relative_to(REPO) if python.is_relative_to(REPO) else python
    return shlex.join([str(shown), "-m", module, *argv])
