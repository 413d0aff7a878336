"""The records stages hand each other (core/handoffs.py): round trips, the on-disk JSON
the committed files hold, and an error naming the file for a missing or malformed one."""

from __future__ import annotations

import json

import pytest

from trainyard.core.errors import TrackingError
from trainyard.core.handoffs import (
    EXPORT_RECORD,
    REGISTRY_RECORD,
    TRAIN_RECORD,
    ExportRecord,
    GpuBusy,
    InputBound,
    Registration,
    RegistryRecord,
    TrainRecord,
)
from trainyard.training.gpu_busy import unavailable
from trainyard.training.perf_verdict import verdict

from conftest import REPO

VERDICT = {
    "compute_ms": 58.829,
    "data_path": "fast",
    "data_wait_fraction": 0.0306,
    "data_wait_ms": 1.861,
    "device": "cpu",
    "fix": "none on the input side",
    "h2d_fraction": 0.0008,
    "h2d_ms": 0.049,
    "level": "not input-bound",
    "placement": "ram",
    "step_ms": 60.739,
    "steps": 2147,
    "timer": "perf_counter",
    "warmup_steps_excluded": 3,
    "why": "3% of a 60.7 ms step waits for the next batch",
}
TRAIN = {
    "best_epoch": 9,
    "best_val_acc": 0.9204,
    "checkpoint": "best.ckpt",
    "checkpoint_sha256": "a" * 64,
    "data_placement": "ram",
    "data_sha256": "b" * 64,
    "data_version": "a30256d907c674a9db906876b7f36b53.dir",
    "device": "cpu",
    "epochs_run": 10,
    "experiment": "trainyard",
    "experiment_id": "1",
    "fit_time_s": 140.7,
    "input_bound": VERDICT,
    "precision": "bf16-mixed",
    "run_id": "dc92b45b8f6c40cdabceafa61e29f6e3",
}
GPU_BUSY = {
    "device": "NVIDIA H200",
    "mean_pct": 87.5,
    "median_pct": 91.0,
    "reason": None,
    "samples": 412,
}
NO_GPU = {
    "device": None,
    "mean_pct": None,
    "median_pct": None,
    "reason": "no CUDA device",
    "samples": 0,
}
EXPORT = {
    "argmax_agreement": 1.0,
    "max_abs_diff": 2.1457672119140625e-06,
    "mlflow_model_uri": "models:/m-94ffc84c3ac44b748322371c77bbf35e",
    "onnx_sha256": "c" * 64,
    "passed": True,
    "provider": "CPUExecutionProvider",
    "samples": 1000,
    "threshold_max_abs_diff": 0.0001,
}
EMBEDDING_PARITY = {
    "embedding_max_abs_diff": 3.814697265625e-06,
    "threshold_embedding_max_abs_diff": 0.00061,
}
REGISTERED = {
    "alias": "champion",
    "already_registered": False,
    "enabled": True,
    "model_name": "fashion-mnist-classifier",
    "model_uri": "models:/fashion-mnist-classifier@champion",
    "previous_champion": None,
    "reason": "first version with a test accuracy: becomes champion",
    "source": "models:/m-94ffc84c3ac44b748322371c77bbf35e",
    "version": 1,
}

CASES = [
    (TrainRecord, TRAIN),
    (TrainRecord, TRAIN | {"input_bound": None}),
    (TrainRecord, TRAIN | {"gpu_busy": GPU_BUSY}),
    (TrainRecord, TRAIN | {"gpu_busy": NO_GPU}),
    (ExportRecord, EXPORT),
    (ExportRecord, EXPORT | EMBEDDING_PARITY),
    (RegistryRecord, REGISTERED),
    (RegistryRecord, REGISTERED | {"previous_champion": 1, "already_registered": True}),
    (RegistryRecord, {"enabled": False}),
]


@pytest.mark.parametrize(("cls", "raw"), CASES)
def test_round_trip_keeps_the_json_on_disk(tmp_path, cls, raw):
    path = tmp_path / "sub" / cls.FILE.name
    record = cls.from_json(raw)
    assert record.write(path) == path
    # Byte for byte what the stages always wrote: sorted keys, indent 2, a final newline.
    assert path.read_text() == json.dumps(raw, indent=2, sort_keys=True) + "\n"
    assert cls.read(path) == record
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temp file left


def test_the_typed_fields():
    train = TrainRecord.from_json(TRAIN)
    assert (train.run_id, train.best_epoch, train.checkpoint) == (TRAIN["run_id"], 9, "best.ckpt")
    assert isinstance(train.input_bound, InputBound) and train.input_bound.steps == 2147
    assert train.gpu_busy is None  # a record from before the figure: none, and not written
    assert "gpu_busy" not in train.to_json()
    busy = TrainRecord.from_json(TRAIN | {"gpu_busy": GPU_BUSY}).gpu_busy
    assert isinstance(busy, GpuBusy) and (busy.mean_pct, busy.samples) == (87.5, 412)
    cpu = TrainRecord.from_json(TRAIN | {"gpu_busy": NO_GPU}).gpu_busy
    assert cpu is not None and cpu.mean_pct is None and cpu.reason == "no CUDA device"
    old_export = ExportRecord.from_json(EXPORT)  # from before the embedding output
    assert old_export.embedding_max_abs_diff is None
    assert "embedding_max_abs_diff" not in old_export.to_json()
    export = ExportRecord.from_json(EXPORT | EMBEDDING_PARITY)
    assert export.threshold_embedding_max_abs_diff == 0.00061
    registry = RegistryRecord.from_json(REGISTERED)
    assert isinstance(registry.registration, Registration)
    assert (registry.registration.version, registry.registration.alias) == (1, "champion")
    assert RegistryRecord(enabled=False).to_json() == {"enabled": False}
    with pytest.raises(ValueError, match="exactly when the registry is enabled"):
        RegistryRecord(enabled=True)
    with pytest.raises(ValueError, match="frozen"):
        train.run_id = "other"  # type: ignore[misc]


def test_paths_are_the_pipelines_and_follow_a_folder(tmp_path):
    assert (TrainRecord.FILE, ExportRecord.FILE, RegistryRecord.FILE) == (
        TRAIN_RECORD,
        EXPORT_RECORD,
        REGISTRY_RECORD,
    )
    assert str(TRAIN_RECORD) == "models/train.json"
    assert str(EXPORT_RECORD) == "reports/export.json"
    assert str(REGISTRY_RECORD) == "reports/registry.json"
    assert TrainRecord.path_in(tmp_path / "ddp") == tmp_path / "ddp" / "train.json"


@pytest.mark.parametrize(
    "cls", [TrainRecord, ExportRecord, RegistryRecord], ids=lambda c: c.__name__
)
def test_the_committed_files_read_and_write_back_unchanged(tmp_path, cls):
    committed = REPO / cls.FILE
    record = cls.read(committed)
    assert record.write(tmp_path / "again.json").read_text() == committed.read_text()


def test_the_gpu_busy_meters_result_fits_the_record():
    assert set(unavailable("no CUDA device")) == set(GpuBusy.model_fields)
    assert GpuBusy.model_validate(unavailable("no CUDA device")).reason == "no CUDA device"


def test_the_meters_verdict_fits_the_record():
    # Every key perf_verdict.verdict gives is a field of InputBound (the meter adds the rest).
    keys = set(verdict(0.1, data_path="fast", device="cpu", placement="ram"))
    assert keys <= set(InputBound.model_fields)


@pytest.mark.parametrize(("cls", "stage"), [(TrainRecord, "train"), (ExportRecord, "export")])
def test_missing_file_names_it_and_the_stage_to_run(tmp_path, cls, stage):
    path = tmp_path / cls.FILE.name
    with pytest.raises(TrackingError, match=rf"{path}: missing; run `dvc repro {stage}` first"):
        cls.read(path)


@pytest.mark.parametrize(
    ("cls", "text", "problem"),
    [
        (TrainRecord, "{not json", "not JSON"),
        (TrainRecord, "[1, 2]", "(top level)"),
        (TrainRecord, json.dumps({k: v for k, v in TRAIN.items() if k != "run_id"}), "run_id"),
        (TrainRecord, json.dumps(TRAIN | {"run_id": ""}), "run_id"),
        (TrainRecord, json.dumps(TRAIN | {"best_epoch": "nine"}), "best_epoch"),
        (TrainRecord, json.dumps(TRAIN | {"typo": 1}), "typo"),
        (ExportRecord, json.dumps(EXPORT | {"samples": None}), "samples"),
        (RegistryRecord, json.dumps({"enabled": True}), "exactly when the registry is enabled"),
        (RegistryRecord, json.dumps(REGISTERED | {"version": "v1"}), "version"),
    ],
)
def test_malformed_file_names_it_and_what_is_wrong(tmp_path, cls, text, problem):
    path = tmp_path / cls.FILE.name
    path.write_text(text)
    with pytest.raises(TrackingError) as err:
        cls.read(path)
    message = str(err.value)
    assert message.startswith(f"{path}: not a valid {cls.FILE.name}: ")
    assert problem in message and f"rerun `dvc repro {cls.STAGE}`" in message


def test_bytes_that_are_not_utf8_are_malformed_too(tmp_path):
    path = tmp_path / "train.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(TrackingError, match=r"not a valid train\.json: not JSON"):
        TrainRecord.read(path)


def test_atomic_outputs_get_an_ordinary_files_mode(tmp_path):
    """mkstemp makes 0600 temp files: an output must instead get what open() would give
    (0666 less the umask), or a teammate's server cannot read a report the stage wrote."""
    import os

    from trainyard.core.io import atomic_dir, atomic_file, atomic_write_text

    umask = os.umask(0o022)
    os.umask(umask)
    written = atomic_write_text(tmp_path / "a.json", "{}")
    with atomic_file(tmp_path / "b.bin") as tmp:
        tmp.write_bytes(b"x")
    with atomic_dir(tmp_path / "c") as tmp:
        (tmp / "f").write_text("x")
    assert written.stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "b.bin").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o777 & ~umask
