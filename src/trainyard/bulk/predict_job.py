"""A bulk-scoring job: its typed options, the job they describe (``predict``), and the one
table of a job's shards (``merge``). The command line that makes the options:
trainyard.bulk.command_line.

The options default to params.yaml's ``predict`` section; the model to ``predict.model``
(``auto``: ``serve.model``, what ``make serve`` serves), a model reference
(trainyard.core.model_ref): a local exported model checked against its ``.sha256``, or a
registry model fetched by the ``ModelRegistry`` the caller passes (MLflow lives in
trainyard.track; ``python -m trainyard.bulk``, which has no MLflow, scores model files
only, as in a bento or a Kubernetes Job).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainyard.bulk import engine
from trainyard.bulk.decode import DecodeSpec, worker_count
from trainyard.bulk.heatmaps import check_explains, heatmap_folder
from trainyard.bulk.listing import Inputs, folder_labels, list_inputs, parse_shard, shard_range
from trainyard.bulk.summary import summary_line, tally
from trainyard.bulk.table import output_format, read_tables, summary_path, write_table
from trainyard.bulk.where_to_score import (
    SAMPLE_IMAGES,
    Place,
    Probe,
    choose_batch,
    choose_place,
    decode_cost,
)
from trainyard.core.card import card_from_metadata
from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import DataError, ModelError
from trainyard.core.io import atomic_write_json
from trainyard.core.model_ref import FetchedModel, ModelRegistry, parse_model_ref
from trainyard.runtime.model_file import open_verified
from trainyard.runtime.sessions import CPU, choose_providers

log = logging.getLogger("trainyard.bulk")


@dataclass(frozen=True)
class PredictOptions:
    """A job as asked: the source, the table (None: ``default_out``), the params file, and
    what overrides its ``predict`` section (None: the params file's value)."""

    source: str
    out: str | None = None
    model: str | None = None
    params: str = str(DEFAULT_PARAMS)
    top_k: int | None = None
    min_confidence: float | None = None
    batch_size: int | None = None
    workers: int | None = None
    device: str | None = None
    chunk_rows: int | None = None
    shard: str = "0/1"  # K/N: the K-th of N slices (0-based)
    strict: bool = False  # stop at the first unreadable file
    explain: bool = False  # each image's heatmap, a PNG beside the table (trainyard.bulk.heatmaps)


def default_out(source: str) -> Path:
    """``predictions/<the source's name>.parquet``."""
    name = Path(source.rstrip("/")).stem or "predictions"
    return Path("predictions") / f"{name.replace('*', '_')}.parquet"


def settings(options: PredictOptions, params: Params) -> dict[str, Any]:
    """The job's settings: an option given (on the command line) wins over params.yaml's
    ``predict`` (validated there: an out-of-range option is the same error as the key's)."""
    given = {
        "top_k": options.top_k,
        "min_confidence": options.min_confidence,
        "batch_size": options.batch_size,
        "workers": options.workers,
        "device": options.device,
        "chunk_rows": options.chunk_rows,
        "model": options.model,
    }
    merged = params.predict.model_dump() | {k: v for k, v in given.items() if v is not None}
    try:
        return type(params.predict).model_validate(merged).model_dump()
    except ValueError as err:
        raise DataError(str(err)) from None


def model_source(options: PredictOptions, chosen: str, params: Params) -> tuple[str, str]:
    """(the model, where it was written): ``--model``, else ``predict.model``, whose
    ``auto`` is ``serve.model``: bulk answers come from the served model."""
    if chosen == "auto":
        return params.serve.model, "serve.model"
    return chosen, "--model" if options.model else "predict.model"


def resolve_model(
    source: str,
    field: str,
    params_file: Path,
    registry: ModelRegistry | None,
    base: Path | None = None,
) -> FetchedModel:
    """(a local .onnx, provenance) for a path (relative to ``base``, else the params
    file's folder), a registry URI or a run (downloaded by ``registry``, sha256-checked);
    ``field``: where ``source`` was written, for messages."""
    ref = parse_model_ref(source, field, base or params_file.parent)
    if ref.path is not None:
        return FetchedModel(ref.path, {"model_source": str(ref.path)})
    if registry is None:
        raise ModelError(
            f"{field}: {ref}: a registry model needs MLflow, which `python -m "
            "trainyard.bulk` does not use: pass an exported model file, or run `trainyard "
            "predict` in the development environment"
        )
    return registry.fetch(ref, params_file.parent / ".cache" / "registry")


def build_job(
    options: PredictOptions, registry: ModelRegistry | None = None
) -> tuple[engine.Job, Params]:
    """Read params, list the source, open and verify the model: the job, ready to run."""
    params_file = Path(options.params).resolve()
    params = load_params(params_file)
    opts = settings(options, params)
    shard = parse_shard(options.shard)
    out = Path(options.out) if options.out else default_out(options.source)
    output_format(out)  # a bad extension is an error before the model is fetched
    inputs = list_inputs(
        options.source,
        image_column=params.data.csv_image_column,
        label_column=params.data.csv_label_column,
    )
    inputs.fingerprint_ahead()  # while the model loads and its batch size is probed
    path, provenance, model, sha = _open_model(options, opts, params, params_file, registry)
    card = card_from_metadata(model.metadata, str(path))
    folder_labels(inputs, model.classes)
    probe = choose_batch(model, path, card.input_shape, opts["batch_size"])
    spec = DecodeSpec(
        card,
        params.data.max_image_pixels,
        params.data.download_timeout_s,
        params.data.csv_max_download_bytes,
        top_k=opts["top_k"],
        batch_size=probe.batch,
        heatmaps=str(heatmap_folder(out)) if options.explain else "",
    )
    place = where_to_score(inputs, shard_range(len(inputs), *shard), spec, probe, opts["workers"])
    if place.inline or probe.single is None:  # scored here: on one thread, or on the GPU
        model = probe.single or model
    else:  # on a CPU the workers score too (one thread each)
        spec = replace(spec, model=str(path))
    job = engine.Job(
        inputs=inputs,
        model=model,
        sha256=sha,
        version=_version(provenance),
        spec=spec,
        out=out,
        fmt=output_format(out),
        top_k=opts["top_k"],
        min_confidence=opts["min_confidence"],
        batch_size=probe.batch,
        workers=1 if place.inline else worker_count(opts["workers"]),  # inline: a thread
        chunk_rows=opts["chunk_rows"],
        shard=shard,
        strict=options.strict,
        about=_about(path, provenance, model.metadata),
        inline=place.inline,
        place=place.reason,
        heatmaps=heatmap_folder(out).name if options.explain else "",
    )
    return job, params


def _open_model(
    options: PredictOptions,
    opts: dict[str, Any],
    params: Params,
    params_file: Path,
    registry: ModelRegistry | None,
) -> tuple[Path, dict[str, Any], Any, str]:
    """The model to score with, found, opened and verified: its path, provenance, the
    loaded model and its sha256."""
    # --model is relative to where the command runs; predict.model to the params file.
    base = Path.cwd() if options.model else None
    source, field = model_source(options, opts["model"], params)
    path, provenance = resolve_model(source, field, params_file, registry, base)
    # On a CPU the session that scores here runs on one thread (where_to_score): opened so
    # once, and the batch probe's too, not a second session of the same file.
    threads = 1 if choose_providers(opts["device"])[0] == CPU else 0
    model, sha = open_verified(path, opts["device"], threads)
    if options.explain:
        check_explains(model, path)
    return path, provenance, model, sha


def _about(path: Path, provenance: dict[str, Any], metadata: dict[str, str]) -> dict[str, str]:
    """Where the model came from, for the table's metadata."""
    return {
        "source": str(path),
        "run_id": provenance.get("run_id") or metadata.get("mlflow_run_id", ""),
        **{k: v for k, v in provenance.items() if v},
    }


def _version(provenance: dict[str, Any]) -> str:
    """The registry's NAME/VERSION, or "local" for a model file."""
    if provenance.get("registry_version"):
        return f"{provenance['registry_model']}/{provenance['registry_version']}"
    return "local"


def where_to_score(
    inputs: Inputs, rows: tuple[int, int], spec: DecodeSpec, probe: Probe, workers: int | str
) -> Place:
    """In this process or in decode workers (trainyard.bulk.where_to_score): on a GPU the
    workers decode; ``predict.workers`` set to a number is that many workers; ``auto``
    measures a few of the rows' decodes here and takes the shorter estimate."""
    if probe.single is None:
        return Place(False, "decode workers, the model on the GPU here")
    if workers != "auto":
        return Place(False, f"{workers} decode worker(s) (predict.workers), each scoring too")
    start, stop = rows
    sample = [
        inputs.location(i)
        for i in range(start, min(stop, start + 4 * SAMPLE_IMAGES))
        if i not in inputs.problems
    ]
    # The fingerprint's thread first (the run waits for it before its first row anyway):
    # beside it, a 28 px PNG's decode measured 0.27-0.49 ms of CPU against 0.16-0.38 ms
    # alone, and sent 20,000 of them to the workers, whose start-up delays the first row.
    inputs.fingerprint()
    cost = decode_cost(sample, spec)
    cores = worker_count("auto")
    return choose_place(stop - start, cost, probe.img_per_s or 1.0, cores, cores)


def predict(options: PredictOptions, registry: ModelRegistry | None = None) -> dict[str, Any]:
    """Build and run the job that ``options`` describe; the summary (also written beside
    the table). A rerun after a kill continues from the chunks written."""
    job, _params = build_job(options, registry)
    start, stop = job.rows
    log.info(
        "scoring %s rows of %s (%s%s) with %s (%s, sha256 %s) on %s%s, batch %d, %s -> %s",
        f"{stop - start:,}",
        job.inputs.where,
        job.inputs.kind,
        f", labels from {job.inputs.label_from}" if job.inputs.label_from else "",
        job.about.get("model_source", job.about["source"]),
        job.version,
        job.sha256[:12],
        job.model.provider,
        " with IO binding" if job.model.io_binding else "",
        job.batch_size,
        job.place,
        job.out,
    )
    summary = engine.run(job)
    log.info("%s -> %s", summary_line(summary), job.out)
    return summary


def merge(shards: list[Path], out: Path) -> dict[str, Any]:
    """The shards of one job (``--shard K/N`` outputs, any order) as the one table a single
    run writes, and its summary; DataError when one is missing, repeated or of another job."""
    if not shards:
        raise DataError("predict-merge: no shard outputs given")
    found = []
    for path in shards:
        side = summary_path(path)
        if not side.is_file():
            raise DataError(f"{path}: no {side.name} beside it; is it a trainyard predict output?")
        found.append((json.loads(side.read_text()), path))
    found.sort(key=lambda item: item[0]["shard"]["index"])
    first = found[0][0]
    count = first["shard"]["count"]
    same = ("fingerprint", "sha256")
    for summary, path in found:
        if (summary["source"]["fingerprint"], summary["model"]["sha256"]) != (
            first["source"]["fingerprint"],
            first["model"]["sha256"],
        ):
            raise DataError(
                f"{path}: another source or model than {found[0][1]} ({', '.join(same)} differ)"
            )
    indexes = [s["shard"]["index"] for s, _ in found]
    if indexes != list(range(count)) or any(s["shard"]["count"] != count for s, _ in found):
        missing = sorted(set(range(count)) - set(indexes))
        raise DataError(
            f"predict-merge: the shards of a {count}-way job are 0..{count - 1}; given "
            f"{indexes}" + (f", missing {missing}" if missing else "")
        )
    fmt = output_format(out)
    first_path = found[0][1]
    tables = (t for _, path in found for t in read_tables(path))
    head = next(read_tables(first_path))
    write_table(out, fmt, tables, head.schema)
    classes = first["model"].get("classes") or list(first["predicted"])
    labels = first.get("labels", {}).get("from", "")
    merged = {k: v for k, v in first.items() if k not in ("shard", "speed", "resumed_rows")}
    merged |= tally(read_tables(out), classes, labels)
    seconds = max(s["speed"]["seconds"] for s, _ in found)
    merged["output"] = str(out)
    merged["shards"] = [
        {"index": s["shard"]["index"], "rows": s["shard"]["rows"], "speed": s["speed"]}
        for s, _ in found
    ]
    merged["speed"] = {
        "img_per_s": merged["scored"] / seconds if seconds else None,
        "seconds": seconds,
    }
    atomic_write_json(summary_path(out), merged)
    return merged
