"""The training report: the fit's history CSV (a real Lightning fit, resumed), the evaluate
stage's pictures (what each one shows), their MLflow artifacts and their dvc.yaml entries."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from matplotlib.figure import Figure
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from trainyard.core.errors import DataError
from trainyard.core.fit_history import COLUMNS, HISTORY_FILE, history_csv, read_history
from trainyard.evaluation.pictures import (
    cell_texts,
    draw_confusion,
    draw_learning_curves,
    draw_mistakes,
    draw_per_class,
    learning_curves_png,
    mistakes_png,
    worst_mistakes,
)
from trainyard.evaluation.scoring import REPORT_FILES, calibration_metrics, classification_metrics
from trainyard.stages.evaluate import (
    EVALUATION_ARTIFACTS,
    REPORT_ARTIFACTS,
    log_evaluation,
    training_history,
)
from trainyard.training.builder import build_trainer
from trainyard.training.history import History

from conftest import REPO

BATCHES = 5  # 70 samples in batches of 16


# ---------------------------------------------------------------------------- History


class Tiny(L.LightningModule):
    """A linear classifier logging what trainyard's Classifier logs; it keeps Lightning's own
    epoch numbers to compare the History rows with."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 3)
        self.epochs: list[dict[str, float]] = []

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{stage}/loss", loss, on_step=stage == "train", on_epoch=True, batch_size=len(y))
        acc = (logits.argmax(1) == y).float().mean()
        self.log(f"{stage}/acc", acc, on_epoch=True, batch_size=len(y))
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def on_train_epoch_end(self) -> None:
        m = self.trainer.callback_metrics
        self.epochs.append({k: float(m[k]) for k in ("train/loss_epoch", "val/loss", "val/acc")})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        # Halved every epoch: the lr column must show the lr each epoch trained with.
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)
    val_x, val_y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
    return (
        DataLoader(TensorDataset(x, y), batch_size=16),
        DataLoader(TensorDataset(val_x, val_y), batch_size=16),
    )


def fit(folder: Path, max_epochs: int, ckpt_path: Path | None = None) -> Tiny:
    L.seed_everything(0, verbose=False)
    model = Tiny()
    every_epoch = ModelCheckpoint(
        dirpath=folder / "ckpt", save_top_k=-1, every_n_epochs=1, enable_version_counter=False
    )
    trainer = build_trainer(
        callbacks=[History(folder / HISTORY_FILE), every_epoch],
        max_epochs=max_epochs,
        num_sanity_val_steps=2,  # a sanity check runs, and must not make a row
        root=folder,
    )
    train, val = loaders()
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("fit")
    # An old run's file: a fresh fit starts its own history.
    stale = [{"epoch": e, "step": e, "val/acc": 0.99} for e in range(1, 6)]
    (folder / HISTORY_FILE).write_text(history_csv(stale))
    model = fit(folder, max_epochs=2)
    return {"folder": folder, "rows": read_history(folder / HISTORY_FILE), "lightning": model}


def test_history_has_one_row_per_epoch_with_what_lightning_logged(fitted):
    rows, logged = fitted["rows"], fitted["lightning"].epochs
    assert [r["epoch"] for r in rows] == [1, 2]  # no sanity-check row, no stale rows
    assert [r["step"] for r in rows] == [BATCHES, 2 * BATCHES]
    assert [r["lr"] for r in rows] == pytest.approx([0.1, 0.05])
    assert len(logged) == 2
    for row, epoch in zip(rows, logged, strict=True):
        assert row["train/loss"] == pytest.approx(epoch["train/loss_epoch"], rel=1e-6)
        assert row["val/loss"] == pytest.approx(epoch["val/loss"], rel=1e-6)
        assert row["val/acc"] == pytest.approx(epoch["val/acc"], rel=1e-6)
        assert 0 < row["epoch_time_s"] < 60
    assert rows[0]["train/loss"] != pytest.approx(rows[1]["train/loss"])  # it learns
    text = (fitted["folder"] / HISTORY_FILE).read_text()
    assert text.splitlines()[0] == ",".join(COLUMNS)


def test_checkpoints_carry_the_rows_and_load_with_weights_only(fitted):
    ckpt = torch.load(fitted["folder"] / "ckpt/epoch=0-step=5.ckpt", weights_only=True)
    state = ckpt["callbacks"]["History"]
    assert state["columns"] == list(COLUMNS)
    assert [dict(zip(COLUMNS, r, strict=True)) for r in state["rows"]] == fitted["rows"][:1]


def test_a_resumed_fit_keeps_earlier_epochs_even_when_dvc_deleted_the_file(fitted, tmp_path):
    (tmp_path / "ckpt").mkdir()
    # DVC deletes models/history.csv before the train stage runs: no file, only the ckpt.
    model = fit(tmp_path, max_epochs=3, ckpt_path=fitted["folder"] / "ckpt/epoch=0-step=5.ckpt")
    rows = read_history(tmp_path / HISTORY_FILE)
    before = fitted["rows"]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert [r["step"] for r in rows] == [BATCHES, 2 * BATCHES, 3 * BATCHES]
    assert rows[0] == before[0]  # from the checkpoint, its epoch time included
    # Epoch 2 was trained again from the same state: the same numbers.
    for key in ("train/loss", "val/loss", "val/acc", "lr"):
        assert rows[1][key] == pytest.approx(before[1][key], rel=1e-6), key
    assert rows[2]["lr"] == pytest.approx(0.025)
    assert len(model.epochs) == 2  # it did resume: epochs 2 and 3 only


def test_a_checkpoint_without_rows_resumes_with_the_file_up_to_its_epoch(fitted, tmp_path):
    ckpt = torch.load(fitted["folder"] / "ckpt/epoch=1-step=10.ckpt", weights_only=True)
    del ckpt["callbacks"]["History"]  # written before the fit had a History
    torch.save(ckpt, tmp_path / "old.ckpt")
    rows = [dict(r) for r in fitted["rows"]]
    rows[0]["epoch_time_s"] = 99.0  # marks the rows that come from the file
    later = {"epoch": 3, "step": 15, "epoch_time_s": 1234.0}  # one the resumed fit redoes
    (tmp_path / HISTORY_FILE).write_text(history_csv([*rows, later]))
    fit(tmp_path, max_epochs=3, ckpt_path=tmp_path / "old.ckpt")
    after = read_history(tmp_path / HISTORY_FILE)
    assert [r["epoch"] for r in after] == [1, 2, 3]
    assert after[:2] == rows  # kept from the file
    assert after[2]["step"] == 15 and after[2]["epoch_time_s"] < 60  # trained, not the stale row
    assert after[2]["train/loss"] is not None and after[2]["val/acc"] is not None


def test_history_file_round_trips_and_bad_files_name_file_and_line(tmp_path):
    rows = [
        {"epoch": 1, "step": 10, "train/loss": 0.5, "val/loss": None, "val/acc": 0.25},
        {"epoch": 2, "step": 20, "train/loss": 0.4, "lr": 1e-05, "epoch_time_s": 3.5},
    ]
    path = tmp_path / HISTORY_FILE
    path.write_text(history_csv(rows))
    back = read_history(path)
    assert back == [{c: r.get(c) for c in COLUMNS} for r in rows]
    path.write_text("epoch,val/acc\n1,0.5\n")
    with pytest.raises(DataError, match=rf"{HISTORY_FILE}: no column step"):
        read_history(path)
    path.write_text("epoch,step,val/acc\n1,10,0.5\n2,20,high\n")
    with pytest.raises(DataError, match=r"line 3, column 'val/acc': 'high' is not a number"):
        read_history(path)


# ---------------------------------------------------------------------------- pictures


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        # Not a blank canvas: a drawn picture has many distinct colours.
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 20
        return im.size


def test_worst_mistakes_are_the_most_confident_wrong_predictions():
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    preds = np.array([0, 2, 2, 1, 1, 0, 2, 0])  # wrong: 1, 3, 5, 6, 7
    conf = np.array([0.99, 0.6, 0.98, 0.9, 0.97, 0.6, 0.4, 0.7], dtype=np.float32)
    # The right ones (0.99, 0.98, 0.97) never count; ties (0.6) keep the lower index first.
    assert worst_mistakes(labels, preds, conf).tolist() == [3, 7, 1, 5, 6]
    assert worst_mistakes(labels, preds, conf, limit=2).tolist() == [3, 7]
    assert worst_mistakes(labels, labels, conf).tolist() == []
    with pytest.raises(ValueError, match="one entry per test image"):
        worst_mistakes(labels, preds, conf[:3])


@pytest.mark.parametrize("channels", [1, 3])
def test_mistakes_grid_shows_those_images_with_true_predicted_and_confidence(channels):
    rng = np.random.default_rng(0)
    n, classes = 60, ["cat", "dog", "T-shirt/top"]
    images = rng.integers(0, 256, (n, channels, 6, 5), dtype=np.uint8)
    labels = rng.integers(0, 3, n)
    preds = np.where(rng.random(n) < 0.5, labels, (labels + 1) % 3)
    conf = rng.random(n).astype(np.float32)
    fig = Figure()
    cells = draw_mistakes(fig, images, labels, preds, conf, classes)
    expected = worst_mistakes(labels, preds, conf, 25)
    assert len(cells) == len(expected) == 25
    for ax, i in zip(cells, expected.tolist(), strict=True):
        assert ax.get_title() == (
            f"true: {classes[labels[i]]}\npred: {classes[preds[i]]} {conf[i]:.2f}"
        )
        shown = np.asarray(ax.images[0].get_array())
        picture = images[i, 0] if channels == 1 else images[i].transpose(1, 2, 0)
        np.testing.assert_array_equal(shown, picture)
    wrong = int((labels != preds).sum())
    assert fig.get_suptitle().startswith(f"The 25 most confident of {wrong} wrong predictions")
    width, height = png_size(mistakes_png(images, labels, preds, conf, classes))
    assert height > width > 500  # 5 rows of 5


def test_mistakes_grid_without_mistakes_says_so():
    images = np.zeros((4, 1, 5, 5), dtype=np.uint8)
    labels = np.arange(4) % 2
    fig = Figure()
    assert draw_mistakes(fig, images, labels, labels, np.ones(4), ["a", "b"]) == []
    assert fig.get_suptitle() == "No wrong predictions on 4 test images"
    assert mistakes_png(images, labels, labels, np.ones(4), ["a", "b"])[:4] == b"\x89PNG"


def test_confusion_counts_and_normalised_show_counts_and_row_shares():
    cm = [[90, 10, 0], [1, 299, 0], [0, 0, 0]]  # the last class has no test images
    classes = ["a", "b", "c"]
    counts = draw_confusion(Figure(figsize=(8, 8)), cm, classes, "t", normalize=False)
    np.testing.assert_array_equal(counts.images[0].get_array(), cm)
    assert [t.get_text() for t in counts.texts] == [str(v) for row in cm for v in row]
    share = draw_confusion(Figure(figsize=(8, 8)), cm, classes, "t", normalize=True)
    np.testing.assert_allclose(
        share.images[0].get_array(), [[0.9, 0.1, 0], [1 / 300, 299 / 300, 0], [0, 0, 0]]
    )
    texts = [t.get_text() for t in share.texts]
    # 1 in 300 reads .01, not 0: only an empty cell is 0; 299/300 rounds to 1.
    assert texts == [".90", ".10", "0", ".01", "1", "0", "0", "0", "0"]
    assert "rows sum to 1" in share.get_title() and "image counts" in counts.get_title()
    assert cell_texts(np.array([[0, 7]]), np.array([[0.0, 0.123]]), True).tolist() == [["0", ".12"]]


def test_per_class_bars_are_precision_and_recall_in_class_order():
    y_true = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    y_pred = np.array([0, 0, 1, 1, 1, 2, 2, 0, 2])
    classes = ["a", "b", "c"]
    per_class = classification_metrics(y_true, y_pred, classes)["per_class"]
    ax = draw_per_class(Figure(figsize=(9, 5)), per_class, classes, "t")
    widths = [bar.get_width() for bar in ax.patches]
    assert widths[:3] == pytest.approx([2 / 3, 2 / 3, 1.0])  # precision: 2/3, 2/3, 3/3
    assert widths[3:] == pytest.approx([2 / 3, 1.0, 0.75])  # recall: 2/3, 2/2, 3/4
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["a (n=3)", "b (n=2)", "c (n=4)"]
    with pytest.raises(ValueError, match="'d'"):
        draw_per_class(Figure(), per_class, [*classes, "d"], "t")


def test_learning_curves_plot_every_column_and_mark_the_best_epoch(fitted):
    rows = fitted["rows"]
    fig = Figure(figsize=(11, 7.5))
    loss, acc, lr, seconds = draw_learning_curves(fig, rows, "History")
    lines = {line.get_label(): line for line in loss.lines}
    np.testing.assert_allclose(lines["train"].get_ydata(), [r["train/loss"] for r in rows])
    np.testing.assert_allclose(lines["val"].get_ydata(), [r["val/loss"] for r in rows])
    np.testing.assert_allclose(acc.lines[0].get_ydata(), [r["val/acc"] for r in rows])
    np.testing.assert_allclose(lr.lines[0].get_ydata(), [0.1, 0.05])
    np.testing.assert_allclose(seconds.lines[0].get_xdata(), [1, 2])
    best = max(rows, key=lambda r: r["val/acc"])
    assert f"best val/acc {best['val/acc']:.4f} at epoch {best['epoch']}" in fig.get_suptitle()
    assert png_size(learning_curves_png(rows, "History")) == (1100, 750)
    empty = Figure()
    assert draw_learning_curves(empty, None, "History") == []
    assert any("no training history" in t.get_text() for t in empty.texts)


def test_missing_history_is_a_warning_not_a_failure(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert training_history(tmp_path / HISTORY_FILE) is None
    assert HISTORY_FILE in caplog.text
    (tmp_path / HISTORY_FILE).write_text(history_csv([{"epoch": 1, "step": 3}]))
    assert training_history(tmp_path / HISTORY_FILE)[0]["step"] == 3


# ---------------------------------------------------------------------------- MLflow, DVC


def test_pictures_are_logged_under_report_and_data_under_evaluation(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    # Named: an experiment an earlier test of this process made active is not in this store.
    experiment = mlflow.set_experiment("report")
    with mlflow.start_run(experiment_id=experiment.experiment_id) as run:
        run_id = run.info.run_id
    paths = {}
    for name, file in REPORT_FILES.items():
        paths[name] = tmp_path / "reports" / file
        paths[name].parent.mkdir(exist_ok=True)
        paths[name].write_bytes(b"x")
    metrics = classification_metrics(np.array([0, 1]), np.array([0, 0]), ["a", "b"])
    metrics |= {"samples": 2, "provider": "CPUExecutionProvider"}
    y, conf = np.array([0, 1]), np.array([0.9, 0.6])
    metrics["calibration"] = calibration_metrics(y, np.array([0, 0]), conf, conf, 1.0)
    reference = tmp_path / "models" / "model.reference.npz"
    reference.parent.mkdir()
    reference.write_bytes(b"x")
    log_evaluation(run_id, {"metrics": metrics, "classes": ["a", "b"]}, paths, reference)
    client = mlflow.MlflowClient()
    drift = {a.path for a in client.list_artifacts(run_id, "reference")}
    assert drift == {"reference/model.reference.npz"}  # trainyard drift --reference models:/
    pictures = {a.path for a in client.list_artifacts(run_id, REPORT_ARTIFACTS)}
    data = {a.path for a in client.list_artifacts(run_id, EVALUATION_ARTIFACTS)}
    assert pictures == {f"report/{f}" for f in REPORT_FILES.values() if f.endswith(".png")}
    assert data == {"evaluation/predictions.csv", "evaluation/classification_report.json"}


def out_paths(stage: dict) -> dict[str, dict]:
    outs = {}
    for out in stage["outs"]:
        path, opts = (out, {}) if isinstance(out, str) else next(iter(out.items()))
        outs[path] = opts or {}
    return outs


def test_every_report_file_is_declared_in_dvc_yaml():
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    train, evaluate = dvc["stages"]["train"], dvc["stages"]["evaluate"]
    assert "--out models" in train["cmd"] and "--reports reports" in evaluate["cmd"]
    history = f"models/{HISTORY_FILE}"
    # The small outputs live in git beside dvc.lock: none of them cached.
    assert out_paths(train)[history] == {"cache": False}
    assert history in evaluate["deps"]
    evaluate_outs = out_paths(evaluate)
    for file in REPORT_FILES.values():
        assert evaluate_outs[f"reports/{file}"] == {"cache": False}, file

    images, curves = set(), {}
    for plot in dvc["plots"]:
        name, spec = (plot, None) if isinstance(plot, str) else next(iter(plot.items()))
        if spec is None:
            images.add(name)
        elif isinstance(spec.get("y"), dict):
            for file, columns in spec["y"].items():
                assert spec["x"] == "epoch"
                curves.setdefault(file, set()).update(
                    [columns] if isinstance(columns, str) else columns
                )
    pngs = {f"reports/{f}" for f in REPORT_FILES.values() if f.endswith(".png")}
    assert pngs <= images
    assert curves == {history: {"train/loss", "val/loss", "val/acc"}}
    assert curves[history] <= set(COLUMNS)
