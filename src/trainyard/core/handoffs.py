"""The records one stage hands to the next: typed, validated, written whole or not at all.

- ``models/train.json`` (``TrainRecord``): written by train, read by export and evaluate;
- ``reports/export.json`` (``ExportRecord``): written by export, read by evaluate;
- ``reports/registry.json`` (``RegistryRecord``): written by evaluate.

Each is a frozen pydantic model with its file's path (``FILE``) and one ``write``/``read``
pair. On disk they stay the flat JSON objects they always were (sorted keys, indent 2): git
holds them beside dvc.lock and other tools read them. A missing or malformed file is a
``TrackingError`` naming the file and the stage to rerun, never a KeyError deep in a stage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainyard.core.errors import TrackingError
from trainyard.core.io import atomic_write_json

TRAIN_RECORD = Path("models/train.json")
EXPORT_RECORD = Path("reports/export.json")
REGISTRY_RECORD = Path("reports/registry.json")


class _Frozen(BaseModel):
    # forbid: a key this code does not know means the file and the code disagree.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Record(_Frozen):
    """A stage's hand-off file: ``FILE`` is its path in the repository, ``STAGE`` the DVC
    stage that writes it (what to rerun when it is missing or unreadable)."""

    FILE: ClassVar[Path]
    STAGE: ClassVar[str]

    @classmethod
    def path_in(cls, folder: str | os.PathLike[str]) -> Path:
        """The record's file in ``folder`` (a stage's ``--models``/``--reports`` folder)."""
        return Path(folder) / cls.FILE.name

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        """The record from the JSON object on disk; pydantic's ValidationError if unfit."""
        return cls.model_validate(raw)

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write atomically to ``path`` (default ``FILE``); return the path."""
        return atomic_write_json(self.FILE if path is None else path, self.to_json())

    @classmethod
    def read(cls, path: str | os.PathLike[str] | None = None) -> Self:
        """Read ``path`` (default ``FILE``); a TrackingError naming it if missing or bad."""
        path = Path(cls.FILE if path is None else path)
        if not path.is_file():
            raise TrackingError(f"{path}: missing; run `dvc repro {cls.STAGE}` first")
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except ValidationError as err:
            problem = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
                for e in err.errors()
            )
        except (ValueError, UnicodeDecodeError) as err:  # not JSON, not UTF-8
            problem = f"not JSON ({err})"
        raise TrackingError(
            f"{path}: not a valid {cls.FILE.name}: {problem}; rerun `dvc repro {cls.STAGE}`"
        )


class InputBound(_Frozen):
    """The input-bound verdict of a fit (``training.perf.InputBoundMeter.result``)."""

    level: str
    data_wait_fraction: float
    h2d_fraction: float
    why: str
    fix: str
    data_wait_ms: float
    h2d_ms: float
    compute_ms: float
    step_ms: float
    steps: int
    warmup_steps_excluded: int
    timer: str
    data_path: str | None
    placement: str | None
    device: str


class GpuBusy(_Frozen):
    """How busy the GPU kept over the training steps (``training.gpu_busy.GpuBusyMeter``):
    NVML utilisation, its mean and median %, or None with the ``reason`` (``no CUDA
    device``, NVML unavailable)."""

    mean_pct: float | None
    median_pct: float | None
    samples: int
    device: str | None  # the GPU's name
    reason: str | None  # why there is no figure; None when there is one


# The checkpoint key of a model refitted on train + val (train.refit): the val-chosen
# model's val logits, on which export fits the temperature.
SELECTED_VAL_LOGITS = "selected_val_logits"


class TrainRecord(Record):
    """What train made: the MLflow run, the best checkpoint and how the fit went."""

    FILE: ClassVar[Path] = TRAIN_RECORD
    STAGE: ClassVar[str] = "train"

    run_id: str = Field(min_length=1)
    experiment_id: str
    experiment: str
    best_val_acc: float
    best_epoch: int
    epochs_run: int
    device: str
    precision: str
    checkpoint: str  # file name, in the same folder as this record
    checkpoint_sha256: str
    data_sha256: str
    data_version: str  # what the registry records: DVC's hash where dvc.lock has it
    data_placement: str
    fit_time_s: float
    input_bound: InputBound | None  # None: no step was measured
    # None only in a record written before trainyard measured it (and written back without)
    gpu_busy: GpuBusy | None = None
    # why the fit ended: max_epochs, early stopping, or the time limit (train.time_limit_min)
    stopped_by: str | None = None
    # train.refit: which images trained the shipped model (trained_on: "train" or "train +
    # val", images, epochs, why; best_epoch is the val-chosen one); None before it
    refit: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk (an older record's keys stay as they were)."""
        raw = super().to_json()
        for key in ("gpu_busy", "stopped_by", "refit"):
            if raw[key] is None:
                del raw[key]
        return raw


class Int8Export(_Frozen):
    """The int8 model export wrote (``export.quantize: int8``; export.quantize's gate)."""

    file: str  # beside model.onnx: model.int8.onnx
    sha256: str
    artifact: str  # its path among the train run's MLflow artifacts
    samples: int  # test images the gate compared
    agreement: float  # share of them with the fp32 model's top-1
    accuracy_fp32: float
    accuracy_int8: float
    accuracy_drop: float  # percentage points
    threshold_min_agreement: float
    threshold_max_accuracy_drop: float
    calibration_samples: int
    outputs: list[str]
    passed: bool


class Calibration(_Frozen):
    """The temperature export baked into the graph (``trainyard.export.calibration``), fitted
    on ``samples`` validation images, and their NLL before and after it."""

    temperature: float = Field(gt=0)
    samples: int = Field(ge=0)
    val_nll_before: float | None = None
    val_nll_after: float | None = None
    # The NLL fit's T, the split's ECE at T = 1 and at it, and the share of bootstrap
    # resamples where it is lower; applied False: not sure enough that the fit helps, the
    # graph carries T = 1 (None: a record from before this guard).
    fitted_temperature: float | None = None
    val_ece_before: float | None = None
    val_ece_after: float | None = None
    val_ece_improved_share: float | None = None
    applied: bool | None = None
    # A model refitted on train + val (train.refit): T is fitted on the val logits of the
    # model validation chose, which the checkpoint carries (None: the exported model's own)
    fitted_on: str | None = None


class ExportRecord(Record):
    """What export made: the ONNX model's parity with PyTorch, its hash and MLflow model."""

    FILE: ClassVar[Path] = EXPORT_RECORD
    STAGE: ClassVar[str] = "export"

    samples: int
    max_abs_diff: float
    argmax_agreement: float
    threshold_max_abs_diff: float
    provider: str
    passed: bool
    onnx_sha256: str
    mlflow_model_uri: str
    # The embedding output's parity (None only in a record from before the model had it,
    # written back without): its max abs diff and the limit it met, relative to its scale.
    embedding_max_abs_diff: float | None = None
    threshold_embedding_max_abs_diff: float | None = None
    # The cam output's parity, likewise (None: a record from before the model had it).
    cam_max_abs_diff: float | None = None
    threshold_cam_max_abs_diff: float | None = None
    int8: Int8Export | None = None  # None: export.quantize none
    calibration: Calibration | None = None  # None: a record from before calibration

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk (an older record's keys stay as they were)."""
        raw = super().to_json()
        for key in (
            "embedding_max_abs_diff",
            "threshold_embedding_max_abs_diff",
            "cam_max_abs_diff",
            "threshold_cam_max_abs_diff",
            "int8",
            "calibration",
        ):
            if raw[key] is None:
                del raw[key]
        if "calibration" in raw:  # its guard's keys likewise (absent from older records)
            raw["calibration"] = {k: v for k, v in raw["calibration"].items() if v is not None}
        return raw


class Registration(_Frozen):
    """One registration (``track.registry.register_and_promote``'s answer)."""

    model_name: str
    version: int
    alias: str
    reason: str
    previous_champion: int | None
    model_uri: str
    source: str
    already_registered: bool


class RegistryRecord(Record):
    """What evaluate did in the registry: nothing (disabled), or one registration."""

    FILE: ClassVar[Path] = REGISTRY_RECORD
    STAGE: ClassVar[str] = "evaluate"

    enabled: bool
    registration: Registration | None = None

    @model_validator(mode="after")
    def _registered_when_enabled(self) -> RegistryRecord:
        if self.enabled != (self.registration is not None):
            raise ValueError(
                "a registration must be there exactly when the registry is enabled "
                f"(enabled {self.enabled}, registration {self.registration is not None})"
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """Flat on disk: the registration's keys beside ``enabled``."""
        reg = self.registration
        return {"enabled": self.enabled} | ({} if reg is None else reg.model_dump(mode="json"))

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        """The flat JSON object back into ``enabled`` + ``registration``."""
        if not isinstance(raw, dict):
            return cls.model_validate(raw)  # pydantic names the wrong type
        rest = {k: v for k, v in raw.items() if k != "enabled"}
        return cls.model_validate({"enabled": raw.get("enabled"), "registration": rest or None})
