"""A stage's log says each fact once, in one format, without other libraries' adverts and
repeats (docs/tracking.md, "The stage log"); training shows progress in a log too."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ProgressBar
from torch.utils.data import DataLoader, TensorDataset

from trainyard.training.builder import build_trainer
from trainyard.training.fit_log import ProgressLog, duration

from conftest import REPO, STAGES, run_ok

# What the pipeline's log held before (a real train/export/evaluate run), by source.
NOISE = (
    "💡 Tip",  # Lightning: litlogger / litmodels adverts
    "GPU available:",  # Lightning's device banner
    "TPU available:",
    "Automatic Mixed Precision",  # Lightning: the precision, said by train
    "Loading `train_dataloader`",
    "`Trainer.fit` stopped",
    "exists and is not empty",  # ModelCheckpoint on train's resume folder
    "LeafSpec",  # FutureWarning: Lightning's use of a deprecated torch API
    "not supported by the model summary",
    "Total params",  # Lightning's model summary table
    "Experiment with name",  # MLFlowLogger creating the experiment
    "Creating initial MLflow database tables",
    "system metrics monitoring",  # MLflow's system-metrics monitor, INFO
    "Skip logging GPU metrics",
    "View run",  # MLflow on a tracking server, at every run's end
)

TINY_FIT = """
import logging, sys
import lightning as L, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from torch.utils.data import DataLoader, TensorDataset

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
    def training_step(self, batch, i):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss
    def validation_step(self, batch, i):
        self.log("val/acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean())
    def configure_optimizers(self):
        steps = self.trainer.estimated_stepping_batches  # as OneCycle's schedule asks
        return torch.optim.SGD(self.parameters(), lr=0.1 / steps)

root, quiet = sys.argv[1], sys.argv[2] == "quiet"
if quiet:  # what the train stage imports, before anything is logged
    from trainyard.stages.runner import configure_logging
    from trainyard.track.system_metrics import SystemMetrics
    from trainyard.training.builder import build_trainer
    configure_logging("train")
data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
ckpt_dir = f"{root}/.cache/train-resume/k"  # as train's: holds the resume state already
open(f"{ckpt_dir}/state.json", "w").write("{}")
uri = f"sqlite:///{root}/mlflow.db"
mlf = MLFlowLogger(experiment_name="e", tracking_uri=uri)
checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/acc", mode="max")
options = dict(logger=mlf, callbacks=[checkpoint], max_epochs=1, precision="bf16-mixed")
if quiet:
    with SystemMetrics(mlf.run_id, uri, 1, True):
        build_trainer(verbose=True, **options).fit(Tiny(), data, data)
    logging.getLogger("trainyard.training.fit").info("best %.4f", 0.5)
else:  # the same with Lightning and MLflow as they come
    monitor = SystemMetricsMonitor(mlf.run_id, sampling_interval=1, tracking_uri=uri)
    monitor.start()
    L.Trainer(enable_progress_bar=False, **options).fit(Tiny(), data, data)
    monitor.finish()
"""


def run_python(code: str, *args: str, cwd: Path = REPO) -> str:
    proc = run_ok([sys.executable, "-c", code, *args], cwd, timeout=300)
    return proc.stdout + proc.stderr


def repeated(lines: list[str]) -> dict[str, int]:
    return {line: n for line, n in Counter(lines).items() if n > 1 and line.strip()}


@pytest.fixture(scope="module")
def tiny_fit_logs(tmp_path_factory) -> dict[str, str]:
    """A tiny real fit with MLflow, as Lightning and MLflow say it and as a stage does."""
    logs = {}
    for mode in ("noisy", "quiet"):
        root = tmp_path_factory.mktemp(mode)
        (root / ".cache/train-resume/k").mkdir(parents=True)
        logs[mode] = run_python(TINY_FIT, str(root), mode)
    return logs


def test_the_tiny_fit_makes_every_known_noise(tiny_fit_logs):
    # The check below means something only if Lightning and MLflow, left alone, say these
    # (the run links need a tracking server: test_mlflow_prints_no_run_links).
    missing = [n for n in NOISE if n not in tiny_fit_logs["noisy"] and n != "View run"]
    assert missing == [], tiny_fit_logs["noisy"]


def test_a_stage_log_holds_none_of_it_and_each_line_once(tiny_fit_logs):
    log = tiny_fit_logs["quiet"]
    assert [n for n in NOISE if n in log] == [], log
    lines = log.splitlines()
    assert repeated(lines) == {}
    # Lightning's summary table becomes one line; trainyard's INFO lines carry the stage.
    assert "[train] model: 10 parameters (all trainable), 0.0 MB as fp32" in lines
    assert "[train] best 0.5000" in lines


FORMAT = """
import logging, warnings
import lightning, mlflow  # their own handlers exist: the stage's configuration replaces them
from trainyard.stages.runner import configure_logging

configure_logging("export")
logging.getLogger("trainyard.export.x").info("parity ok")
logging.getLogger("trainyard.export.x").warning("slow disk")
logging.getLogger("trainyard.export.x").debug("not shown")
logging.getLogger("lightning.pytorch.callbacks.timer").info("Time limit reached.")
logging.getLogger("mlflow.store.x").warning("store is old")
logging.getLogger("onnxscript.x").info("not shown: other libraries say warnings only")
for _ in range(2):  # the same place twice: shown once, as Python does
    warnings.warn("a user warning", UserWarning)
"""


def test_stage_log_format():
    lines = run_python(FORMAT).splitlines()
    assert lines == [
        "[export] parity ok",
        "[export] WARNING slow disk",
        "[export] lightning: Time limit reached.",
        "[export] WARNING mlflow: store is old",
        "[export] WARNING a user warning (UserWarning, <string>:14)",
    ]


def test_mlflow_prints_no_run_links(capsys):
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    import trainyard.track  # noqa: F401  (its import sets MLflow's switch)

    # MLflow writes its links to stdout for a tracking server only; with the switch on, it
    # returns before asking the server (none listens here) for the run.
    TrackingServiceClient("http://127.0.0.1:9")._log_url("0" * 32)
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- training progress


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", 0.5)  # never improves: early stopping's patience runs out

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(progress: ProgressLog, max_epochs: int = 2, callbacks=()) -> None:
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = build_trainer(callbacks=[progress, *callbacks], max_epochs=max_epochs)
    trainer.fit(Tiny(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainyard.training.fit_log"]


def test_progress_lines_within_epochs(caplog):
    caplog.set_level("INFO", logger="trainyard.training.fit_log")
    fit(ProgressLog(every_s=0))  # a line at every step
    lines = progress_lines(caplog)
    assert lines[0] == "model: 10 parameters (all trainable), 0.0 MB as fp32"
    steps = [line.split(",")[0] for line in lines[1:]]
    assert steps == [f"epoch {e}/2 step {s}/4 ({25 * s}%)" for e in (1, 2) for s in (1, 2, 3, 4)]
    first, last = lines[1].split(", "), lines[4].split(", ")
    assert first[1].startswith("loss ") and float(first[1].removeprefix("loss ")) > 0
    assert first[2].endswith(" img/s") and first[3].startswith("ETA ")
    assert len(last) == 3  # the epoch's last step: no ETA


def test_no_progress_lines_under_a_bar_or_within_the_interval(caplog):
    caplog.set_level("INFO", logger="trainyard.training.fit_log")
    fit(ProgressLog(periodic=False, every_s=0))
    fit(ProgressLog(every_s=3600))
    assert progress_lines(caplog) == ["model: 10 parameters (all trainable), 0.0 MB as fp32"] * 2


def test_early_stopping_says_why(caplog):
    caplog.set_level("INFO", logger="trainyard.training.fit_log")
    early = EarlyStopping(monitor="val/acc", mode="max", patience=1)
    fit(ProgressLog(every_s=3600), max_epochs=5, callbacks=[early])
    assert progress_lines(caplog)[-1] == (
        "early stopping after epoch 2/5: Monitored metric val/acc did not improve in the "
        "last 1 records. Best score: 0.500."
    )


def test_duration():
    assert [duration(s) for s in (0, 45.4, 60, 725, 7380)] == [
        "0s",
        "45s",
        "1m00s",
        "12m05s",
        "2h03m",
    ]


def test_bar_on_a_terminal_periodic_lines_otherwise(monkeypatch, tmp_path):
    def progress(trainer: L.Trainer) -> tuple[bool, list[bool]]:
        bar = any(isinstance(c, ProgressBar) for c in trainer.callbacks)
        return bar, [c.periodic for c in trainer.callbacks if isinstance(c, ProgressLog)]

    main, other = os.openpty()  # a real terminal
    with open(other, "w") as terminal, (tmp_path / "log").open("w") as file:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert progress(build_trainer(verbose=True)) == (True, [False])
        monkeypatch.setattr(sys, "stderr", file)
        assert progress(build_trainer(verbose=True)) == (False, [True])
        assert progress(build_trainer()) == (False, [])  # benchmarks and tests: quiet
    os.close(main)


# ---------------------------------------------------------------- the real pipeline


# What `dvc repro` itself prints around the stages (its stdout), each line whole; or blank.
DVC_LINES = re.compile(
    r"Running stage '\w+':|> exec python -m trainyard\.stages\.\w+ .*|"
    r"(Generating|Updating) lock file 'dvc\.lock'|Use `dvc push` to send your updates to "
    r"remote storage\.|"
)


@pytest.mark.slow
def test_pipeline_log_says_each_fact_once_without_noise(reproduced_pipeline):
    """The suite's first `dvc repro` of the small pipeline, every stage run as a user runs
    them: each stage's lines marked with it, none twice, no noise, no warning that
    trainyard's own code makes a library raise; every other line is DVC's."""
    log = (reproduced_pipeline.parent / "first_repro.log").read_text()
    lines: dict[str, list[str]] = {stage: [] for stage in STAGES}
    unmarked = []
    for line in log.splitlines():
        mark = re.match(r"\[(\w+)\] ", line)
        if mark and mark.group(1) in lines:
            lines[mark.group(1)].append(line)
        elif not DVC_LINES.fullmatch(line):
            unmarked.append(line)  # a stage's line without its mark (a bar: on a terminal)
    problems = {"unmarked": unmarked} if unmarked else {}
    for stage, said in lines.items():
        text = "\n".join(said)
        found = {
            "said nothing": not said,
            "noise": [n for n in NOISE if n in text],
            "twice": repeated(said),
            "our warning": [line for line in said if re.search(r"Warning, trainyard/", line)],
        }
        if any(found.values()):
            problems[stage] = found
    assert problems == {}, json.dumps(problems, indent=1, ensure_ascii=False)
