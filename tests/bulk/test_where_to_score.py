"""Where trainyard predict decodes and scores (``trainyard.bulk.where_to_score``): in this
process for images cheaper to decode than to send, in decode workers for photos; either
way the same table. Tasks to workers sized by bytes; a console script's main never re-run
by a worker."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import test_predict
from PIL import Image

from trainyard.bulk import command_line, engine, where_to_score
from trainyard.bulk import predict_job as command
from trainyard.bulk.decode import TASK_BYTES, TASK_MAX_IMAGES, DecodeSpec
from trainyard.bulk.engine import process_age
from trainyard.bulk.listing import list_inputs
from trainyard.bulk.where_to_score import POOL_START_S, choose_batch, choose_place

from conftest import REPO, stage_env

# test_predict's tiny model and photo folder (module fixtures), and the card they share.
CARD, model, photos = test_predict.CARD, test_predict.model, test_predict.photos


def options(source: Path, out: Path, model: Path, *extra: str) -> command.PredictOptions:
    parser = command_line.add_predict_arguments(argparse.ArgumentParser())
    args = [str(source), "--out", str(out), "--model", str(model)]
    parsed = parser.parse_args([*args, "--params", str(REPO / "params.yaml"), *extra])
    return command_line.predict_options(parsed)


def test_small_images_are_scored_here_and_answer_as_the_workers_do(model, photos, tmp_path):
    """predict.workers auto on small images: in this process (the summary says so and
    why); the table is the one two decode workers write, byte for byte in Parquet."""
    root, made = photos
    here = command.predict(options(root, tmp_path / "here.parquet", model, "--chunk-rows", "16"))
    there = command.predict(
        options(root, tmp_path / "there.parquet", model, "--chunk-rows", "16", "--workers", "2")
    )
    assert here["speed"]["scoring"].startswith("in this process")
    assert here["speed"]["scoring"].endswith("the model on one thread")
    assert "decode" in here["speed"]["place"] and "ms" in here["speed"]["place"]
    assert there["speed"]["scoring"] == "in the decode workers, one thread each"
    assert there["speed"]["place"].startswith("2 decode worker(s) (predict.workers)")
    assert pq.read_table(tmp_path / "here.parquet").equals(
        pq.read_table(tmp_path / "there.parquet")
    )
    assert here["bad_files"] == len(made["bad"]) and here["scored"] == len(made["good"])
    for summary in (here, there):  # from this process's start: not longer than its age
        assert 0 < summary["speed"]["first_row_s"] <= process_age()


@pytest.mark.parametrize(
    ("rows", "decode_ms", "model_ms", "workers", "inline"),
    [
        (20_000, 0.15, 0.2, 2, True),  # 28 px PNGs: a worker's start-up is never earned back
        (10_000, 2.2, 4.0, 2, False),  # photos: both cores decode and score
        (50, 2.2, 4.0, 2, True),  # a few photos: done before a worker would start
        (10_000, 2.2, 4.0, 1, True),  # one core: a worker only adds its start-up
    ],
)
def test_the_place_is_the_shorter_estimate(rows, decode_ms, model_ms, workers, inline):
    place = choose_place(rows, decode_ms / 1e3, 1e3 / model_ms, workers, workers)
    assert place.inline is inline, place.reason
    assert f"decode {decode_ms:.2f} ms" in place.reason and f"{POOL_START_S:.0f} s" in place.reason


@pytest.mark.parametrize(
    ("rates", "chosen"),
    [
        ({1: 900, 4: 2_000, 16: 3_900, 64: 3_800}, 64),  # a near tie: the larger batch
        ({1: 900, 4: 2_000, 16: 4_000, 64: 3_600}, 16),  # 10% slower: the best stays
        ({1: 250, 4: 240, 16: 200, 64: 9_999}, 4),  # 20% slower ends the probe (Lite0)
        ({1: 1_000, 4: 980, 16: 960, 64: 950}, 64),  # ties are measured on the best rate
        ({1: 1_000, 4: 970, 16: 940, 64: 920}, 4),  # ... so they cannot drift down
    ],
)
def test_the_cpu_batch_is_the_fastest_or_a_larger_near_tie(monkeypatch, rates, chosen):
    """The rule over measured rates (the measurement itself: the start-up runs above)."""
    cpu = argparse.Namespace(provider="CPUExecutionProvider")
    monkeypatch.setattr(where_to_score, "_one_thread", lambda model, path: model)
    monkeypatch.setattr(where_to_score, "_rate", lambda model, x: rates[len(x)])
    probe = choose_batch(cpu, Path("m.onnx"), (1, 28, 28), "auto")
    assert (probe.batch, probe.img_per_s) == (chosen, rates[chosen])


def test_tasks_to_workers_hold_about_the_same_bytes(tmp_path, model):
    """Many tiny files share a task (up to TASK_MAX_IMAGES), a file of TASK_BYTES closes
    one, and a task where the workers score holds at least a model batch."""
    root = tmp_path / "mixed" / "circle"
    root.mkdir(parents=True)
    for i in range(1500):
        (root / f"t{i:04d}.png").write_bytes(b"x" * 300)
    for i in range(3):
        (root / f"z{i}.jpg").write_bytes(b"x" * (TASK_BYTES + 1))
    job, _ = command.build_job(options(root.parent, tmp_path / "o.parquet", model))
    inputs = list_inputs(str(root.parent))
    assert 300 * TASK_MAX_IMAGES < TASK_BYTES  # tiny files: the count closes their tasks
    full, rest = divmod(1500, TASK_MAX_IMAGES)
    tiny = [TASK_MAX_IMAGES] * full + [rest + 1]  # the last tiny ones and the first big one
    for scoring, expected in (("", [*tiny, 1, 1]), (str(model), [*tiny, 2])):
        spec = DecodeSpec(CARD, 10**9, 1.0, 10**6, model=scoring)
        probe = engine.Job(
            **{**job.__dict__, "inputs": inputs, "spec": spec, "inline": False, "batch_size": 4}
        )
        sizes = [len(locations) for locations, _, _ in engine._tasks(probe, [0])]
        assert sizes == expected, scoring


SCRIPT = """\
import sys
with open({mark!r}, "a") as fh:
    fh.write("ran\\n")
from trainyard.bulk.__main__ import main
if __name__ == "__main__":
    sys.exit(main())
"""


def test_a_console_script_is_not_run_again_by_the_workers(model, photos, tmp_path):
    """Run as a script (as the `trainyard` console script is), predict's decode workers
    would run it again each (every command's imports: seconds); they do not."""
    root, _made = photos
    mark = tmp_path / "ran.txt"
    script = tmp_path / "predict_script.py"
    script.write_text(SCRIPT.format(mark=str(mark)))
    out = tmp_path / "s.parquet"
    cmd = [sys.executable, str(script), str(root), "--out", str(out), "--model", str(model)]
    proc = subprocess.run(
        [*cmd, "--workers", "2"], capture_output=True, text=True, env=stage_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.with_name("s.summary.json").read_text())
    assert summary["speed"]["scoring"] == "in the decode workers, one thread each"
    assert mark.read_text() == "ran\n"  # the command itself, once


def test_cheap_decodes_get_batches_here_without_stat(tmp_path, model, photos, monkeypatch):
    """In this process a task is about TASK_PIXELS of model input, never less than a batch;
    each names the source's row of its first file (a heatmap's file name)."""
    root, _made = photos
    job, _ = command.build_job(options(root, tmp_path / "o.parquet", model, "--batch-size", "4"))
    assert job.inline and job.spec.model == ""
    monkeypatch.setattr(engine, "TASK_PIXELS", 1)  # smaller than an image: a batch a task
    tasks = list(engine._tasks(job, [0]))
    sizes = [len(locations) for locations, _, _ in tasks]
    assert set(sizes[:-1]) == {4} and sum(sizes) == len(job.inputs)
    assert [first for _, _, first in tasks] == [4 * i for i in range(len(tasks))]
    pixels = math.prod(job.spec.card.input_shape)
    monkeypatch.setattr(engine, "TASK_PIXELS", 3 * pixels)  # three images' worth: 4 still
    assert {len(t[0]) for t in list(engine._tasks(job, [0]))[:-1]} == {4}
    monkeypatch.setattr(engine, "TASK_PIXELS", 6 * pixels)
    tasks = list(engine._tasks(job, [0]))
    sizes = [len(locations) for locations, _, _ in tasks]
    assert len(tasks) > 1 and set(sizes[:-1]) == {6} and sum(sizes) == len(job.inputs)
    assert [first for _, _, first in tasks] == [6 * i for i in range(len(tasks))]


def test_one_image_a_process_costs_its_decode(tmp_path, model):
    """The sample decode skips the first (a format's plugin loads) and reads the rest."""
    from trainyard.bulk.where_to_score import decode_cost

    folder = tmp_path / "few"
    folder.mkdir()
    paths = []
    for i in range(3):
        Image.fromarray(np.full((20, 20, 3), i * 40, np.uint8)).save(folder / f"{i}.png")
        paths.append(str(folder / f"{i}.png"))
    spec = DecodeSpec(CARD, 10**9, 1.0, 10**6)
    assert 0 < decode_cost(paths, spec) < 1.0
    assert decode_cost([], spec) == 0.0
