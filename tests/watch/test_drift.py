"""trainyard drift: the statistics against scipy, the reference file, the calibration
targets on real Fashion-MNIST through a small model fitted here, the CLI's exit codes and
report, and the evaluate stage's reference from an ONNX model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageFilter
from scipy import stats as sps

from trainyard.core.config import DriftParams, Params
from trainyard.core.errors import DataError
from trainyard.data.idx import read_idx
from trainyard.evaluation.scoring import evaluate_onnx
from trainyard.watch import stats
from trainyard.watch.current import read_window, window_from_table
from trainyard.watch.drift_score import CLASS_MIX, CONFIDENCE, EMBEDDING, Window, compare
from trainyard.watch.log import PredictionLog, utc_now
from trainyard.watch.reference import (
    build_reference,
    load_reference,
    reference_from_predictions,
    sample_rows,
    save_reference,
)

from conftest import fashion_card, write_tiny_onnx

REPO = Path(__file__).resolve().parents[2]
CLASSES = [f"c{i}" for i in range(10)]
WINDOW = 500  # rows in each calibration window


# ---------------------------------------------------------------- the statistics


@pytest.mark.parametrize("a,x", [(0.5, 0.1), (2, 3), (4.5, 20), (10, 2), (50, 60), (0.5, 40)])
def test_chi2_survival_matches_scipy(a: float, x: float) -> None:
    assert stats.chi2_sf(2 * x, int(2 * a)) == pytest.approx(
        sps.chi2.sf(2 * x, int(2 * a)), rel=1e-9
    )
    assert stats.gamma_q(a, x) == pytest.approx(sps.gamma.sf(x, a), rel=1e-9, abs=1e-300)


def test_chi2_two_sample_matches_scipy_contingency() -> None:
    rng = np.random.default_rng(1)
    ref, cur = rng.integers(0, 80, 10), rng.integers(0, 80, 10)
    ref[3] = cur[3] = 0  # a class neither side predicted: left out, not a division by zero
    ref[5] = 0  # a class only the window holds: counts fully
    got, dof = stats.chi2_two_sample(ref, cur)
    seen = (ref + cur) > 0
    want = sps.chi2_contingency(np.stack([ref[seen], cur[seen]]), correction=False)
    assert (got.statistic, got.p_value, dof) == pytest.approx((want[0], want[1], want[2]))


def test_psi_is_zero_for_equal_mixes_and_grows_with_the_shift() -> None:
    base = np.array([100, 200, 300, 400])
    assert stats.psi(base, base * 3) == pytest.approx(0.0, abs=1e-12)
    p, q = base / base.sum(), np.array([400, 300, 200, 100]) / 1000
    assert stats.psi(base, q * 1000) == pytest.approx(float(((q - p) * np.log(q / p)).sum()))
    assert np.isfinite(stats.psi(np.array([10, 0, 5]), np.array([0, 10, 5])))  # epsilon


def test_ks_matches_scipy() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=300), rng.normal(0.25, size=700)
    got = stats.ks_two_sample(a, b)
    want = sps.ks_2samp(a, b, method="asymp")
    assert got.statistic == pytest.approx(want.statistic)
    en = 300 * 700 / 1000
    assert got.p_value == pytest.approx(sps.kstwobign.sf(np.sqrt(en) * want.statistic), rel=1e-9)
    assert got.p_value == pytest.approx(want.pvalue, rel=0.3)  # scipy: the finite-n kstwo
    ties = np.round(a, 1), np.round(b, 1)  # ties within and across: the CDFs at each value
    assert stats.ks_two_sample(*ties).statistic == pytest.approx(sps.ks_2samp(*ties).statistic)


def test_mmd_matches_a_direct_sum_and_its_permutation_p_value_is_calibrated() -> None:
    from scipy.spatial.distance import cdist

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(60, 5)), rng.normal(size=(40, 5)) + 0.8
    z = np.concatenate([x, y])
    d2 = cdist(z, z, "sqeuclidean")
    k = np.exp(-d2 / np.median(d2[np.triu_indices(100, 1)]))
    direct = k[:60, :60].mean() + k[60:, 60:].mean() - 2 * k[:60, 60:].mean()
    shifted = stats.mmd_permutation(x, y, permutations=500)
    assert shifted.statistic == pytest.approx(direct)
    assert shifted.p_value == pytest.approx(1 / 501)  # no permutation comes near
    same = [stats.mmd_permutation(*rng.normal(size=(2, 80, 5)), seed=s).p_value for s in range(40)]
    assert 0.2 < np.mean(same) < 0.8  # uniform under the null, not stuck at 0 or 1


def test_mmd_is_fast_at_the_largest_embedding() -> None:
    import time

    rng = np.random.default_rng(4)
    x = rng.normal(size=(3000, 1280)).astype(np.float32)
    start = time.perf_counter()
    stats.mmd_permutation(x, x[::-1] + 0.01, permutations=2000)
    assert time.perf_counter() - start < 2.0  # well under a second on a free core


# ---------------------------------------------------------------- the reference file


def _reference(embeddings: bool = True):
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(10), 3000)
    emb = rng.normal(size=(3000, 8)) if embeddings else None
    return build_reference(CLASSES, probs, emb, model_sha256="ab" * 32, sample=1000, seed=7)


@pytest.mark.parametrize("embeddings", [True, False])
def test_reference_round_trip(tmp_path: Path, embeddings: bool) -> None:
    ref = _reference(embeddings)
    assert ref.class_counts.sum() == ref.n == 3000 and ref.confidence.shape == (1000,)
    back = load_reference(save_reference(ref, tmp_path / "r.npz"))
    assert back.classes == ref.classes and back.model_sha256 == ref.model_sha256
    assert np.array_equal(back.class_counts, ref.class_counts)
    assert np.array_equal(back.confidence, ref.confidence)
    assert (back.embeddings is None) == (not embeddings)
    if embeddings:
        assert np.array_equal(back.embeddings, ref.embeddings)
    assert [p.name for p in tmp_path.iterdir()] == ["r.npz"]  # no temp file left


def test_reference_takes_embeddings_already_sampled() -> None:
    rng = np.random.default_rng(6)
    preds, conf = rng.integers(0, 10, 5000), rng.uniform(0.1, 1, 5000)
    emb = rng.normal(size=(5000, 3))
    rows = sample_rows(5000, 500, 0)
    whole = reference_from_predictions(CLASSES, preds, conf, emb, model_sha256="x", sample=500)
    kept = reference_from_predictions(CLASSES, preds, conf, emb[rows], model_sha256="x", sample=500)
    assert np.array_equal(whole.embeddings, kept.embeddings)


def test_bad_reference_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing\.npz: no model reference"):
        load_reference(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(DataError, match=r"text\.npz: not a readable model reference"):
        load_reference(tmp_path / "text.npz")
    np.savez(tmp_path / "foreign.npz", weights=np.zeros(3))
    with pytest.raises(DataError, match=r"foreign\.npz: not a readable"):
        load_reference(tmp_path / "foreign.npz")
    ref = _reference()
    bad = {
        "header": np.frombuffer(
            json.dumps(
                {
                    "format": "trainyard.reference",
                    "version": 1,
                    "classes": CLASSES,
                    "has_embeddings": False,
                }
            ).encode(),
            np.uint8,
        ),
        "class_counts": ref.class_counts[:3],
        "confidence": ref.confidence,
    }
    np.savez(tmp_path / "damaged.npz", **bad)
    with pytest.raises(DataError, match=r"damaged\.npz: a damaged .*class counts"):
        load_reference(tmp_path / "damaged.npz")


# ---------------------------------------------------------------- calibration on real data


class SmallModel:
    """A real classifier of Fashion-MNIST, cheap enough to fit here: the 50 principal
    components of 6,000 training images (its embedding) and a softmax regression on them
    (about 81% test accuracy)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        x = images.reshape(len(images), -1) / 255.0
        self.mean = x.mean(axis=0)
        self.axes = np.linalg.svd(x - self.mean, full_matrices=False)[2][:50].T
        e, onehot = self.embed(images), np.eye(10)[labels]
        self.w, self.b = np.zeros((50, 10)), np.zeros(10)
        for _ in range(300):
            g = (self.probs(e) - onehot) / len(e)
            self.w -= 0.5 * e.T @ g
            self.b -= 0.5 * g.sum(axis=0)

    def embed(self, images: np.ndarray) -> np.ndarray:
        return (images.reshape(len(images), -1) / 255.0 - self.mean) @ self.axes

    def probs(self, e: np.ndarray) -> np.ndarray:
        z = e @ self.w + self.b
        z = np.exp(z - z.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    def window(self, images: np.ndarray) -> Window:
        e = self.embed(images)
        p = self.probs(e)
        labels = np.array(CLASSES)[p.argmax(axis=1)]
        return Window(labels, p.max(axis=1).astype(np.float32), e.astype(np.float32), "test")


@pytest.fixture(scope="module")
def fashion(fashion_dir: Path) -> dict:
    """The model, its reference from the first half of the test split, and the second half
    (held out: what live traffic of the same distribution looks like)."""
    train = read_idx(fashion_dir / "train-images-idx3-ubyte.gz")[:6000]
    train_labels = read_idx(fashion_dir / "train-labels-idx1-ubyte.gz")[:6000]
    test = read_idx(fashion_dir / "t10k-images-idx3-ubyte.gz")
    test_labels = read_idx(fashion_dir / "t10k-labels-idx1-ubyte.gz")
    model = SmallModel(train, train_labels.astype(np.int64))
    e = model.embed(test[:5000])
    p = model.probs(e)
    assert (p.argmax(axis=1) == test_labels[:5000]).mean() > 0.75  # a model worth watching
    reference = build_reference(CLASSES, p, e, model_sha256="f" * 64, sample=2000)
    return {
        "model": model,
        "ref": reference,
        "held": test[5000:],
        "held_labels": test_labels[5000:],
    }


def _slice(fashion: dict, seed: int, weights: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    held = fashion["held"]
    return held[rng.choice(len(held), WINDOW, replace=False, p=weights)]


def test_held_out_slices_are_flagged_at_most_once_in_20(fashion: dict) -> None:
    params = Params().drift  # the shipped thresholds
    flagged = [
        compare(fashion["ref"], fashion["model"].window(_slice(fashion, s)), params).drifted
        for s in range(20)
    ]
    assert sum(flagged) <= 1, flagged


def _blur(images: np.ndarray, radius: float) -> np.ndarray:
    blur = ImageFilter.GaussianBlur(radius)
    return np.stack([np.asarray(Image.fromarray(i).filter(blur)) for i in images])


def _digits() -> np.ndarray:
    """Another dataset: sklearn's handwritten digits (8x8, 0..16) as 28x28 uint8."""
    from sklearn.datasets import load_digits

    small = (load_digits().images * 255 / 16).astype(np.uint8)
    return np.stack(
        [np.asarray(Image.fromarray(i).resize((28, 28), Image.BILINEAR)) for i in small]
    )


SHIFTS = {
    # shift -> (images of seed s, the measures that must be named)
    "inverted": (lambda f, s: 255 - _slice(f, s), {CLASS_MIX, CONFIDENCE, EMBEDDING}),
    "blurred": (lambda f, s: _blur(_slice(f, s), 1.0), {CONFIDENCE, EMBEDDING}),
    # three times as many of classes 0-4 as of 5-9
    "class mix": (
        lambda f, s: _slice(f, s, (w := np.where(f["held_labels"] < 5, 3.0, 1.0)) / w.sum()),
        {CLASS_MIX},
    ),
    "another dataset": (
        lambda f, s: _digits()[np.random.default_rng(s).choice(1797, WINDOW)],
        {CLASS_MIX, CONFIDENCE, EMBEDDING},
    ),
}


@pytest.mark.parametrize("shift", list(SHIFTS))
def test_shifted_inputs_are_flagged_every_time_naming_the_measure(
    fashion: dict, shift: str
) -> None:
    make, named = SHIFTS[shift]
    for seed in range(100, 105):
        result = compare(fashion["ref"], fashion["model"].window(make(fashion, seed)))
        assert result.drifted, (shift, seed, result.summary)
        assert named <= set(result.drifted_measures), (shift, seed, result.summary)
        assert result.summary.startswith("drift: ")
        assert all(name in result.summary for name in named)


def test_a_small_window_and_unknown_labels_are_errors_not_verdicts(fashion: dict) -> None:
    window = fashion["model"].window(_slice(fashion, 0)[:49])
    with pytest.raises(DataError, match=r"49 usable rows.*drift\.min_rows"):
        compare(fashion["ref"], window)
    w = fashion["model"].window(_slice(fashion, 0))
    labels = w.labels.astype(object)
    labels[:3] = "sneaker-v2"
    with pytest.raises(DataError, match="sneaker-v2"):
        compare(fashion["ref"], Window(labels, w.probabilities, None, "t"))


def test_a_window_of_another_models_answers_names_the_version_to_compare_with() -> None:
    # After a champion swap, the workspace's reference is often another model's: the
    # error says which registered version answered and how to use its reference.
    table = pa.table(
        {
            "label": ["Coat"] * 60 + ["Bag"] * 2,
            "probability": [0.9] * 62,
            "model_version": ["a" * 12] * 60 + ["b" * 12] * 2,
            "registry_version": ["fm/1"] * 60 + ["fm/2"] * 2,
        }
    )
    window = window_from_table(table, "log", model_sha256="b" * 64)
    why = "another model than the reference's (bbbbbbbbbbbb); fm/1 answered them"
    assert window.n == 2 and window.skipped == {f"{why} (--reference models:/fm/1)": 60}
    with pytest.raises(DataError) as err:
        compare(_reference(embeddings=False), window)
    assert str(err.value) == (  # another model's rows: its reference, not a wider window
        "log: 2 usable rows, drift needs at least 50 (drift.min_rows) to tell a shift from "
        f"noise: 60 rows skipped: {why} (--reference models:/fm/1)"
    )
    # A predict table names its model by the whole sha256, its registered version in
    # model_version: one of another model is refused, not compared (a false verdict).
    scored = pa.table(
        {
            "label": ["Coat"] * 60,
            "probability": [0.9] * 60,
            "error": [None] * 60,
            "model_version": ["fm/1"] * 60,
            "model_sha256": ["a" * 64] * 60,
        }
    )
    assert window_from_table(scored, "t.parquet", model_sha256="a" * 64).n == 60
    other = window_from_table(scored, "t.parquet", model_sha256="b" * 64)
    assert other.n == 0 and other.skipped == {f"{why} (--reference models:/fm/1)": 60}


def test_without_embeddings_class_mix_and_confidence_only_said_once(fashion: dict) -> None:
    w = fashion["model"].window(255 - _slice(fashion, 1))
    result = compare(fashion["ref"], Window(w.labels, w.probabilities, None, "t"))
    assert [m.name for m in result.measures] == [CLASS_MIX, CONFIDENCE]
    assert result.drifted and result.summary.count("class mix and confidence only") == 1
    assert sum("class mix and confidence only" in n for n in result.notes) == 1


def test_permutations_too_few_for_alpha_is_a_params_error() -> None:
    with pytest.raises(ValueError, match="permutations"):
        DriftParams(alpha=0.001, permutations=500)


# ---------------------------------------------------------------- the command


class Ran:
    """What one ``trainyard drift`` call did: its exit code and its two streams."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run_cli(*args: str, cwd: Path, capsys: pytest.CaptureFixture) -> Ran:
    """``trainyard drift ARGS`` through the ``trainyard`` command's own parser, in process
    (a subprocess would pay the command's imports on every call)."""
    import os

    from trainyard.cli import main

    before = os.getcwd()
    os.chdir(cwd)
    try:
        capsys.readouterr()
        code = main(["drift", *args, "--params", str(REPO / "params.yaml")])
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    finally:
        os.chdir(before)
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


def _write_log(folder: Path, window: Window, model_version: str) -> None:
    log = PredictionLog(folder, rotate_rows=200).start()
    for label, prob, emb in zip(
        window.labels, window.probabilities, window.embeddings, strict=True
    ):
        row = {
            "time": utc_now(),
            "label": str(label),
            "probability": float(prob),
            "embedding": emb.tolist(),
            "model_version": model_version,
        }
        assert log.offer(row)
    log.close()


def test_cli_on_a_prediction_log_folder(
    fashion: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ref_path = save_reference(fashion["ref"], tmp_path / "model.reference.npz")
    same, shifted = tmp_path / "same", tmp_path / "shifted"
    _write_log(same, fashion["model"].window(_slice(fashion, 3)), "f" * 12)
    _write_log(shifted, fashion["model"].window(_blur(_slice(fashion, 4), 1.5)), "f" * 12)
    _write_log(shifted, fashion["model"].window(_slice(fashion, 5)[:20]), "0" * 12)  # another model

    ok = _run_cli(
        str(same),
        "--reference",
        str(ref_path),
        "--out",
        "r0",
        "--last",
        "1h",
        cwd=tmp_path,
        capsys=capsys,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("no drift in class mix, confidence, embedding (n=500)")
    assert {p.name for p in (tmp_path / "r0").iterdir()} == {
        "report.md",
        "report.json",
        "class_mix.png",
        "confidence.png",
        "embedding.png",
    }

    bad = _run_cli(
        str(shifted), "--reference", str(ref_path), "--out", "r1", cwd=tmp_path, capsys=capsys
    )
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.startswith("drift: confidence (KS p=")
    report = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert report["drifted"] and report["n"] == 500
    assert report["skipped"] == {"another model than the reference's (ffffffffffff)": 20}
    assert "![confidence](confidence.png)" in (tmp_path / "r1" / "report.md").read_text()

    since = _run_cli(
        str(same),
        "--reference",
        str(ref_path),
        "--since",
        "2999-01-01",
        cwd=tmp_path,
        capsys=capsys,
    )
    assert since.returncode == 2 and "0 usable rows" in since.stderr
    for args, named in [
        (["--last", "soon"], "--last 'soon'"),
        (["--since", "yesterday"], "--since 'yesterday'"),
        (["--reference", str(tmp_path / "nope.npz")], "nope.npz"),
    ]:
        out = _run_cli(str(same), *args, cwd=tmp_path, capsys=capsys)
        assert out.returncode == 2 and named in out.stderr, out.stderr


def test_cli_on_a_predict_table(
    fashion: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ref_path = save_reference(fashion["ref"], tmp_path / "model.reference.npz")
    w = fashion["model"].window(_slice(fashion, 6, None)[:WINDOW])
    n = w.n
    table = pa.table(
        {
            "path": [f"img{i}.png" for i in range(n + 5)],
            "label": [*w.labels.tolist(), None, None, None, None, None],
            "probability": pa.array(
                [*w.probabilities.tolist(), None, None, None, None, None], pa.float32()
            ),
            "error": [*([None] * n), *(["cannot identify image"] * 5)],
        }
    )
    pq.write_table(table, tmp_path / "scores.parquet")
    out = _run_cli(
        "scores.parquet", "--reference", str(ref_path), "--out", "r", cwd=tmp_path, capsys=capsys
    )
    assert out.returncode == 0, out.stderr
    assert "no drift in class mix, confidence (n=500); class mix and confidence only" in out.stdout
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["skipped"] == {"unreadable (an error, no prediction)": 5}
    assert not (tmp_path / "r" / "embedding.png").exists()

    with_emb = table.slice(0, n).append_column(
        "embedding", pa.array(w.embeddings.tolist(), pa.list_(pa.float32()))
    )
    inverted = fashion["model"].window(255 - _slice(fashion, 7))
    with_emb = with_emb.set_column(1, "label", pa.array(inverted.labels.tolist()))
    with_emb = with_emb.set_column(2, "probability", pa.array(inverted.probabilities))
    with_emb = with_emb.set_column(
        4, "embedding", pa.array(inverted.embeddings.tolist(), pa.list_(pa.float32()))
    )
    pq.write_table(with_emb, tmp_path / "inverted.parquet")
    window = read_window(tmp_path / "inverted.parquet")
    assert window.embeddings is not None and window.embeddings.shape == (n, 50)
    out = _run_cli(
        "inverted.parquet", "--reference", str(ref_path), "--out", "r2", cwd=tmp_path, capsys=capsys
    )
    assert out.returncode == 1 and "embedding (MMD p=" in out.stdout, out.stdout + out.stderr

    pq.write_table(pa.table({"path": ["a"], "score": [1.0]}), tmp_path / "other.parquet")
    out = _run_cli("other.parquet", "--reference", str(ref_path), cwd=tmp_path, capsys=capsys)
    assert out.returncode == 2 and "other.parquet: no label or probability column" in out.stderr


# ---------------------------------------------------------------- evaluate's reference


@pytest.mark.parametrize("embedding", [True, False])
def test_evaluate_keeps_the_sampled_rows_embeddings(tmp_path: Path, embedding: bool) -> None:
    card = fashion_card()
    path, weights = write_tiny_onnx(tmp_path, card, embedding=embedding)
    rng = np.random.default_rng(8)
    images = rng.integers(0, 256, (300, 1, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 300)
    rows = sample_rows(300, 100, 0)
    result = evaluate_onnx(path, images, labels, 64, "cpu", embedding_rows=rows)
    if not embedding:  # a model exported before the embedding output: logits only
        assert result["embeddings"] is None
        return
    x = (images[rows].reshape(100, -1) / 255.0 - card.mean[0]) / card.std[0]
    want = x.astype(np.float32) @ weights["embedding_weight"]
    np.testing.assert_allclose(result["embeddings"], want, rtol=1e-4, atol=1e-3)
    ref = reference_from_predictions(
        result["classes"],
        result["predictions"],
        result["confidence"],
        result["embeddings"],
        model_sha256="s",
        sample=100,
    )
    assert ref.embeddings.shape == (100, 4) and ref.n == 300
