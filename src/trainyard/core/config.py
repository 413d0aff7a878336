"""Typed, validated params: the one reader of params.yaml.

Every stage validates the *whole* file, so a mistyped key anywhere fails fast with its
dotted name (``train.max_epoch: unknown key``) instead of being silently ignored.
The models' defaults are params.yaml's values (tests/core/test_config.py holds them equal), so
code that builds ``Params()`` without the file runs what the pipeline runs.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trainyard.core.config_serving import DriftParams, PredictParams, ServeParams
from trainyard.core.errors import ParamsError
from trainyard.core.strict import Strict

# The error type of a value that holds a secret: its message is said, never the value.
SECRET_ERROR = "secret_in_value"

DEFAULT_PARAMS = Path("params.yaml")
TRAIN_POOL_SIZE = 60_000  # images in Fashion-MNIST's train file (train + validation come from it)


class DataParams(Strict):
    source: Literal["fashion-mnist", "folder", "csv"] = "fashion-mnist"
    folder: str | None = "examples/shapes"  # a bundled 3-class sample
    # csv source: a CSV of image paths (relative to it) or URLs, labels and splits. Never
    # null: it is a DVC dep of prepare, which must exist whatever the source.
    csv: str = Field("examples/shapes.csv", min_length=1)
    csv_image_column: str = Field("image", min_length=1)
    csv_label_column: str = Field("label", min_length=1)
    csv_split_column: str | None = Field("split", min_length=1)
    csv_max_download_bytes: int = Field(50_000_000, ge=1024, le=2**31)
    on_bad_file: Literal["error", "skip"] = "error"
    # folder and csv sources
    image_size: (
        Annotated[int, Field(ge=8, le=1024)]
        | tuple[Annotated[int, Field(ge=8, le=1024)], Annotated[int, Field(ge=8, le=1024)]]
        | Literal["auto"]
    ) = "auto"
    resize: Literal["crop", "pad", "stretch"] = "crop"
    channels: Literal["auto", 1, 3] = "auto"
    val_fraction: float = Field(0.1, ge=0, lt=1)
    test_fraction: float = Field(0.1, ge=0, lt=1)
    dedupe: bool = False
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = "auto"
    # Your own images are training data, not untrusted uploads: this guards only against
    # an image too large for memory (serve.max_image_pixels guards the service).
    max_image_pixels: int = Field(1_000_000_000, ge=1, le=20_000_000_000)
    # fashion-mnist source
    source_dir: str | None = None
    debian_dir: str = "/usr/share/datasets/fashion-mnist"
    mirrors: list[str] = Field(
        default_factory=lambda: [
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ]
    )
    download_timeout_s: float = Field(60.0, gt=0, le=3600)
    val_size: int = Field(5000, ge=10)
    limit: int | None = Field(None, ge=20, le=TRAIN_POOL_SIZE)

    @field_validator("mirrors")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"mirror {url!r} must start with http:// or https://")
        return v

    @model_validator(mode="after")
    def _split_fits(self) -> DataParams:
        pool = self.limit or TRAIN_POOL_SIZE
        if self.val_size >= pool:
            raise ValueError(
                f"val_size ({self.val_size}) must be smaller than the train pool "
                f"({pool}{' = data.limit' if self.limit else ''})"
            )
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError(
                f"val_fraction + test_fraction ({self.val_fraction} + {self.test_fraction}) "
                "must leave at least 10% of each class for training"
            )
        if self.source == "folder" and not self.folder:
            raise ValueError(
                "source is 'folder' but data.folder is not set; set it to your "
                "class-per-subfolder image tree (dvc exp run -S data.folder=/path/to/photos)"
            )
        columns = [self.csv_image_column, self.csv_label_column, self.csv_split_column]
        if len(set(columns)) < len(columns):
            raise ValueError(
                "csv_image_column, csv_label_column and csv_split_column must be different "
                f"columns (got {columns})"
            )
        return self

    @property
    def size_hw(self) -> tuple[int, int] | None:
        """(height, width) of prepared folder or csv images; None for ``auto`` (prepare picks it
        from the images' own sizes)."""
        s = self.image_size
        if s == "auto":
            return None
        return (s, s) if isinstance(s, int) else (s[0], s[1])


Auto = Literal["auto"]


class TrainParams(Strict):
    """``auto`` keys are filled by the recipe (``train.recipe``) from the dataset card and
    the hardware; a value the user sets always wins (trainyard.training.recipe)."""

    recipe: Literal["auto", "classic"] = "auto"
    # fixed: epochs from the budget at the device kind's nominal speed (the same plan on a
    # busy or a quiet machine); timed: from a timed probe of this machine (varies run to run)
    plan: Literal["fixed", "timed"] = "fixed"
    time_budget_min: float | None = Field(4.0, gt=0, le=7 * 24 * 60)
    # A hard stop: auto = 1.25x the budget under plan timed, none under plan fixed
    time_limit_min: Annotated[float, Field(gt=0, le=7 * 24 * 60)] | Auto | None = "auto"
    # trainyard.model.networks.ARCH_NAMES (tests/model/test_models.py holds the two equal)
    arch: (
        Literal[
            "cnn",
            "resnet",
            "resnet18",
            "resnet50",
            "mobilenet_v3_small",
            "mobilenet_v3_large",
            "efficientnet_b0",
            "efficientnet_lite0",
        ]
        | Auto
    ) = "auto"
    # auto: the recipe fine-tunes ImageNet weights where they help and can be had (the
    # packaged EfficientNet-Lite0, or torchvision's for its archs) | imagenet | a file | null
    pretrained: str | None = Field("auto", min_length=1)
    max_epochs: Annotated[int, Field(ge=1, le=1000)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=65536)] | Auto = "auto"
    lr: Annotated[float, Field(gt=0, le=10)] | Auto = "auto"
    weight_decay: float = Field(0.05, ge=0, le=1)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    augment: Literal["none", "shift", "flip"] | Auto = "auto"
    data_path: Literal["fast", "naive"] = "fast"
    device_resident: bool = True
    memory_budget: float = Field(0.5, gt=0, le=0.95)
    channels_last: bool = False
    compile: bool | Auto = "auto"
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | Literal["auto"] = "auto"
    precision: Literal[
        "auto", "32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "64-true"
    ] = "auto"
    early_stopping_patience: Annotated[int, Field(ge=1)] | Auto = "auto"
    deterministic: bool = False
    limit_train_batches: int | float | None = None
    # Lightning's num_nodes: the same train command on every node (torchrun or SLURM sets
    # MASTER_ADDR, MASTER_PORT, NODE_RANK); rank 0 owns the MLflow run and the outputs.
    num_nodes: int = Field(1, ge=1, le=4096)
    resume: Literal["auto", "never"] = "auto"
    # auto: once validation chose the epochs, a fine-tune of pretrained weights is fitted
    # again on train + val for them (trainyard.training.refit); true: any run; false: never
    refit: bool | Auto = "auto"
    checkpoint_every_min: float = Field(10.0, ge=0, le=24 * 60)

    @field_validator("augment", mode="before")
    @classmethod
    def _augment_bool(cls, v: Any) -> Any:
        # Older params files said true/false: true was shift + flip.
        if v is True:
            return "flip"
        if v is False:
            return "none"
        return v


# Archs trainyard's own (no ImageNet weights exist for them).
SCRATCH_ARCHS = ("cnn", "resnet")


def pretrained_intent(tp: TrainParams) -> bool:
    """Whether training may start from ImageNet weights: ``train.pretrained`` set, or
    ``auto`` under the auto recipe with an arch that has them. prepare sizes images for
    them (``data.image_size: auto``); the recipe then decides from the data."""
    if tp.pretrained is None:
        return False
    if tp.pretrained != "auto":
        return True
    return tp.recipe == "auto" and tp.arch not in SCRATCH_ARCHS


class ExportParams(Strict):
    opset: int = Field(18, ge=13, le=23)
    parity_samples: int = Field(1000, ge=1, le=10_000)
    max_abs_diff: float = Field(1e-4, gt=0, le=1)
    # A temperature fitted on the val split and baked into the graph: confidences that mean
    # what they say (trainyard.export.calibration); the answers (argmax) stay the same.
    calibrate: bool = True
    # int8: also models/model.int8.onnx (ONNX Runtime static quantization), gated on the
    # whole test set against the fp32 model: top-1 agreement and the accuracy it loses.
    quantize: Literal["none", "int8"] = "none"
    calibration_samples: int = Field(256, ge=1, le=100_000)  # seeded train images
    int8_min_agreement: float = Field(0.99, ge=0, le=1)  # share of test images, 0..1
    int8_max_accuracy_drop: float = Field(0.5, ge=0, le=100)  # percentage points


class EvaluateParams(Strict):
    batch_size: int = Field(1024, ge=1, le=65536)
    device: Literal["auto", "cpu", "cuda"] = "auto"


class MlflowParams(Strict):
    # auto: one experiment per dataset (fashion-mnist, or the folder's name)
    experiment: str = Field("auto", min_length=1)
    system_metrics: bool = True
    system_metrics_interval_s: float = Field(5.0, ge=0.5, le=600)


class RegistryParams(Strict):
    enabled: bool = True
    model_name: str = Field("auto", min_length=1, pattern=r"^[\w.-]+$")
    promote_margin: float = Field(0.0, ge=0, le=1)


class TuneRange(Strict):
    """A numeric range of one param: ints when both ends are ints, else floats."""

    # int | float: an end written as 0.0 stays a float (a range of floats), 0 an int.
    low: int | float
    high: int | float
    log: bool = False
    step: int | float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> TuneRange:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0 (got {self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("log and step cannot both be set (Optuna samples one or the other)")
        return self

    @property
    def is_int(self) -> bool:
        """Integers when both ends (and the step) are written as integers: 16..256, not
        0.0..1.0."""
        ends = (self.low, self.high) + (() if self.step is None else (self.step,))
        return all(isinstance(v, int) and not isinstance(v, bool) for v in ends)


class TuneChoices(Strict):
    choices: list[Any] = Field(min_length=1)


class TuneParams(Strict):
    """``trainyard tune``: an Optuna study over ``space`` (dotted params keys)."""

    trials: int = Field(20, ge=1, le=100_000)
    timeout_min: float | None = Field(None, gt=0, le=30 * 24 * 60)
    study: str = Field("auto", min_length=1, pattern=r"^[\w.-]+$")
    storage: str = Field("auto", min_length=1)
    pruner: Literal["median", "none"] = "median"
    pruner_warmup_epochs: int = Field(2, ge=0, le=1000)
    space: dict[str, TuneRange | TuneChoices] = Field(
        default_factory=lambda: {
            "train.lr": TuneRange(low=0.0003, high=0.01, log=True),
            "train.weight_decay": TuneRange(low=0.0001, high=0.1, log=True),
            "train.batch_size": TuneChoices(choices=[32, 64, 128, 256]),
            "train.label_smoothing": TuneRange(low=0.0, high=0.2),
        }
    )

    @field_validator("space", mode="before")
    @classmethod
    def _entries(cls, v: Any) -> Any:
        # Each entry is a range or a list of choices, told apart by its keys, and an error
        # names the entry (a plain union would list both shapes' complaints).
        if not isinstance(v, dict):
            return v
        known = Params().flat()
        out: dict[str, TuneRange | TuneChoices] = {}
        for key, entry in v.items():
            if key not in known:
                raise ValueError(
                    f"{key!r} is not a params key the search can set (e.g. train.lr, "
                    "train.batch_size; see params.yaml)"
                )
            if isinstance(entry, (TuneRange, TuneChoices)):
                out[key] = entry
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"{key}: expected {{low, high}} or {{choices: [...]}}")
            kind = TuneChoices if "choices" in entry else TuneRange
            try:
                out[key] = kind.model_validate(entry)
            except ValidationError as err:
                why = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'entry'}: "
                    + e["msg"].removeprefix("Value error, ")
                    for e in err.errors()
                )
                raise ValueError(f"{key}: {why}") from None
        return out

    @field_validator("storage")
    @classmethod
    def _no_password(cls, v: str) -> str:
        # params.yaml is committed, and logged as the runs' MLflow params.
        url = urllib.parse.urlsplit(v)
        if url.password is not None or "password" in urllib.parse.parse_qs(url.query):
            raise PydanticCustomError(
                SECRET_ERROR,  # _describe does not echo the value
                "the URL holds a password, and params.yaml is committed and logged as MLflow "
                "params: leave it out (postgresql://USER@HOST/DB) and set PGPASSWORD or "
                "~/.pgpass, which libpq reads",
            )
        return v


class Params(Strict):
    seed: int = Field(42, ge=0, le=2**32 - 1)
    data: DataParams = Field(default_factory=DataParams)
    train: TrainParams = Field(default_factory=TrainParams)
    export: ExportParams = Field(default_factory=ExportParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    mlflow: MlflowParams = Field(default_factory=MlflowParams)
    registry: RegistryParams = Field(default_factory=RegistryParams)
    serve: ServeParams = Field(default_factory=ServeParams)
    tune: TuneParams = Field(default_factory=TuneParams)
    predict: PredictParams = Field(default_factory=PredictParams)
    drift: DriftParams = Field(default_factory=DriftParams)

    def dataset_name(self) -> str:
        """The data's short name: ``fashion-mnist``, the image folder's own name, or the
        CSV's folder and name (``flowers/labels.csv``: ``flowers-labels``, so two datasets'
        ``labels.csv`` do not share an experiment or a registered model)."""
        if self.data.source == "folder" and self.data.folder:
            base = re.sub(r"[^\w.-]+", "-", Path(self.data.folder).expanduser().resolve().name)
            return base.strip("-.") or "folder"
        if self.data.source == "csv":
            path = Path(self.data.csv).expanduser().resolve()
            base = re.sub(r"[^\w.-]+", "-", f"{path.parent.name}-{path.stem}")
            return base.strip("-.") or "csv"
        return self.data.source

    def experiment_name(self) -> str:
        """``mlflow.experiment``, or with ``auto`` one per dataset (``dataset_name``): a photo
        model's runs do not sit among Fashion-MNIST's."""
        return self.dataset_name() if self.mlflow.experiment == "auto" else self.mlflow.experiment

    def registry_model_name(self) -> str:
        """``registry.model_name``, or with ``auto`` one per dataset: fashion-mnist-classifier,
        or <folder name>-classifier; versions of one name must be comparable to compete."""
        if self.registry.model_name != "auto":
            return self.registry.model_name
        return f"{self.dataset_name()}-classifier"

    def flat(self) -> dict[str, Any]:
        """Dotted keys (``train.lr``) for MLflow params; the search space (``tune``) and bulk
        scoring (``predict``) shape no single training (the study's parent run and the
        predict run record them), nor does watching the served model (``drift``)."""
        return flatten(self.model_dump(exclude={"tune", "predict", "drift"}))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


_TYPE_TAGS = frozenset({"int", "float", "str", "bool", "list", "tuple", "dict", "none"})


def _key(loc: tuple[Any, ...]) -> str:
    """The dotted key of an error location, without pydantic's union-member tags
    (``train.max_epochs.constrained-int`` -> ``train.max_epochs``)."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (str(p).isidentifier() and str(p) not in _TYPE_TAGS)
    ]
    return ".".join(parts) or "(top level)"


def _describe(err: ValidationError, source: str) -> str:
    # One line per key: a value that fits no member of a union (an int or "auto") gets
    # each member's complaint joined with "or", and the value once.
    found: dict[str, tuple[list[str], Any]] = {}
    for e in err.errors():
        key = _key(e["loc"])
        if e["type"] == "extra_forbidden":
            msg = "unknown key (typo? see params.yaml for the valid keys)"
        else:
            msg = e["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own
        got = dict if e["type"] == SECRET_ERROR else e.get("input", dict)  # dict: no value
        msgs, got = found.setdefault(key, ([], got))
        if msg not in msgs:
            msgs.append(msg)
    lines = [f"invalid params in {source}:"]
    for key, (msgs, got) in found.items():
        text = " or ".join(msgs)
        if got is not dict and not isinstance(got, dict) and "unknown key" not in text:
            text += f" (got {got!r})"
        lines.append(f"  {key}: {text}")
    return "\n".join(lines)


def parse_params(raw: Any, source: str = "params") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of keys, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(_describe(err, source)) from None


def load_params(path: str | os.PathLike[str] = DEFAULT_PARAMS) -> Params:
    """Read and validate params.yaml; raise ParamsError naming the bad key."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found (run from the repository root)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    return parse_params(raw, str(path))
