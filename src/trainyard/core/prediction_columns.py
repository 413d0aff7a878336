"""The prediction tables' columns, each spelled once: the table ``trainyard predict`` writes
(``trainyard.bulk.table``), the service's prediction log (``trainyard.watch.log``) and what
``trainyard drift`` reads of either (``trainyard.watch.current``). docs/predict.md's column
table is this module in prose (tests/core/test_prediction_columns.py holds them equal).

A column's type is a plain name (core imports no pyarrow): a ``pyarrow.type_for_alias``
name, or ``UTC_TIME``; each writer builds its pyarrow schema from these.
"""

from __future__ import annotations

from dataclasses import dataclass

UTC_TIME = "timestamp[us, tz=UTC]"  # the one type pyarrow's aliases do not name
# A predict table's file format, by its extension (what predict writes, what drift reads).
TABLE_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # string, float32, int32, bool, binary, or UTC_TIME
    is_list: bool = False  # a list of dtype per row


@dataclass(frozen=True)
class Columns:
    """One table's columns, in order; ``optional``: those a table may lack (present only
    when the source gave them, or when the model has them)."""

    columns: tuple[Column, ...]
    optional: frozenset[str] = frozenset()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.name not in self.optional)

    def without(self, *absent: str) -> tuple[Column, ...]:
        """The columns, less the optional ones named in ``absent``."""
        unknown = set(absent) - self.optional
        if unknown:
            raise ValueError(f"not optional columns: {', '.join(sorted(unknown))}")
        return tuple(c for c in self.columns if c.name not in absent)


# Both tables
LABEL = Column("label", "string")  # the top-1 class; null for a row with no prediction
PROBABILITY = Column("probability", "float32")  # the top-1's probability
MODEL_VERSION = Column("model_version", "string")  # predict: NAME/N or local; log: sha256[:12]
EMBEDDING = Column("embedding", "float32", is_list=True)  # the model's embedding output

# trainyard predict's table
PATH = Column("path", "string")  # as the source lists it
TOP_LABELS = Column("top_labels", "string", is_list=True)
TOP_PROBABILITIES = Column("top_probabilities", "float32", is_list=True)
LOW_CONFIDENCE = Column("low_confidence", "bool")
TRUE_LABEL = Column("true_label", "string")  # only when the source gave labels
ERROR = Column("error", "string")  # why the file could not be scored, else null
MODEL_SHA256 = Column("model_sha256", "string")
HEATMAP = Column("heatmap", "string")  # only with --explain: the row's PNG, beside the table

# The prediction log
TIME = Column("time", UTC_TIME)
ROUTE = Column("route", "string")
REGISTRY_VERSION = Column("registry_version", "string")  # NAME/N, or local
CLASS_ID = Column("class_id", "int32")
TOP_K_LABELS = Column("top_k_labels", "string", is_list=True)
TOP_K_PROBS = Column("top_k_probs", "float32", is_list=True)
WIDTH = Column("width", "int32")  # the upload, before any resize
HEIGHT = Column("height", "int32")
FORMAT = Column("format", "string")  # PNG, JPEG, ... (null for pixel arrays)
LATENCY_MS = Column("latency_ms", "float32")  # decode + inference of the answering model
SHADOW_MODEL_VERSION = Column("shadow_model_version", "string")  # shadow_*: null without one
SHADOW_REGISTRY_VERSION = Column("shadow_registry_version", "string")
SHADOW_LABEL = Column("shadow_label", "string")
SHADOW_PROBABILITY = Column("shadow_probability", "float32")
SHADOW_LATENCY_MS = Column("shadow_latency_ms", "float32")
IMAGE = Column("image", "binary")  # only with serve.log_images

PREDICT_TABLE = Columns(
    (
        PATH,
        LABEL,
        PROBABILITY,
        TOP_LABELS,
        TOP_PROBABILITIES,
        LOW_CONFIDENCE,
        TRUE_LABEL,
        ERROR,
        MODEL_VERSION,
        MODEL_SHA256,
        HEATMAP,
    ),
    optional=frozenset({TRUE_LABEL.name, HEATMAP.name}),
)
# Every column is in every file: a shadow_* column is null when no shadow runs, embedding
# for a model exported without its embedding output, image without serve.log_images.
PREDICTION_LOG = Columns(
    (
        TIME,
        ROUTE,
        MODEL_VERSION,
        REGISTRY_VERSION,
        LABEL,
        CLASS_ID,
        PROBABILITY,
        TOP_K_LABELS,
        TOP_K_PROBS,
        WIDTH,
        HEIGHT,
        FORMAT,
        LATENCY_MS,
        EMBEDDING,
        SHADOW_MODEL_VERSION,
        SHADOW_REGISTRY_VERSION,
        SHADOW_LABEL,
        SHADOW_PROBABILITY,
        SHADOW_LATENCY_MS,
        IMAGE,
    )
)
# What drift reads of a log or a predict table: a row with an error is skipped, a log's
# rows of another model_version than the reference's too; embedding where the table has it.
DRIFT_WINDOW = Columns(
    (LABEL, PROBABILITY, EMBEDDING, ERROR, MODEL_VERSION),
    optional=frozenset({EMBEDDING.name, ERROR.name, MODEL_VERSION.name}),
)
