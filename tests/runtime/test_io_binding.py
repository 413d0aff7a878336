"""ONNX Runtime IO binding: chosen on CUDA, plain ``session.run`` elsewhere, and reported.

The binding function takes its device as a parameter, so the very code CUDA runs is run
here on the CPU device and must give ``session.run``'s outputs bit for bit. The CUDA run
itself is the GPU-marked test at the end (skipped without a GPU). Both paths return the
logits by name and the embedding only when asked, and a one-output model (exported before
the embedding) runs on both.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_serve_unit import write_tiny_model

from trainyard.core.card import METADATA_KEY, Card
from trainyard.core.config import ServeParams
from trainyard.evaluation.scoring import evaluate_onnx
from trainyard.runtime import sessions
from trainyard.runtime.inputs import model_input, softmax
from trainyard.runtime.sessions import CPU, CUDA, binding_device, load_onnx, run_bound
from trainyard.serve.predictor import Predictor

from conftest import save_onnx, write_tiny_onnx

SRC = Path(__file__).resolve().parents[2] / "src" / "trainyard"
CARD = Card("folder", tuple(f"c{i}" for i in range(5)), 1, 12, 12, (0.3,), (0.2,))


def conv_model(path: Path, card: Card = CARD) -> Path:
    """conv -> relu -> global pool -> gemm: kernels like a real classifier's, dynamic batch."""
    rng = np.random.default_rng(0)
    c, h, w = card.input_shape
    init = {
        "conv_w": rng.standard_normal((8, c, 3, 3)),
        "conv_b": rng.standard_normal(8),
        "fc_w": rng.standard_normal((8, card.num_classes)),
        "fc_b": rng.standard_normal(card.num_classes),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["act"]),
            helper.make_node("GlobalAveragePool", ["act"], ["pool"]),
            helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        ],
        "conv",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", c, h, w])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", card.num_classes])],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in init.items()],
    )
    save_onnx(graph, path, {METADATA_KEY: json.dumps(card.contract())})
    return path


def count_bound_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batch sizes that went through ``run_bound`` (still run by it): proves the path taken."""
    seen: list[int] = []

    def counted(session, feeds, device, device_id=0, outputs=None):
        value = next(iter(feeds.values()))
        shape = value.shape() if isinstance(value, ort.OrtValue) else value.shape
        seen.append(shape[0])
        return run_bound(session, feeds, device, device_id, outputs)

    monkeypatch.setattr(sessions, "run_bound", counted)
    return seen


def batch(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *CARD.input_shape)).astype(np.float32)


# ---------------------------------------------------------------------------- the choice


@pytest.mark.parametrize(
    ("providers", "expected"),
    [
        ([CUDA, CPU], "cuda"),
        ([CUDA], "cuda"),
        ([CPU], None),
        ([CPU, CUDA], None),  # the running provider is the first one
        ([], None),
    ],
)
def test_binding_is_chosen_on_cuda_only(providers, expected):
    assert binding_device(providers) == expected


def test_a_cpu_session_runs_plain_and_says_so(tmp_path):
    model = load_onnx(conv_model(tmp_path / "m.onnx"), "cpu", say=False)
    assert model.provider == CPU
    assert model.bind_device is None and model.io_binding is False


def test_binding_code_is_defined_once():
    """Evaluation and the service reach IO binding only through runtime.sessions."""
    users = sorted(
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if ".io_binding()" in p.read_text()
    )
    assert users == ["runtime/sessions.py"]


# ---------------------------------------------------------------------------- the binding


def test_bound_run_on_the_cpu_device_equals_session_run(tmp_path):
    """Batch 1, a larger batch, and shape changes back and forth on one session."""
    session = load_onnx(conv_model(tmp_path / "m.onnx"), "cpu", intra_op_threads=1).session
    for i, n in enumerate([1, 257, 1, 64, 257]):
        x = batch(n, seed=i)
        expected = session.run(None, {"image": x})[0]
        got = run_bound(session, {"image": x}, "cpu").copy_outputs_to_cpu()[0]
        assert got.shape == (n, CARD.num_classes) and got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    # Distinct inputs give distinct outputs: the comparison can fail.
    assert not np.array_equal(expected[:1], session.run(None, {"image": batch(1, seed=99)})[0])


def test_an_ortvalue_feed_is_bound_as_is_and_outputs_stay_put(tmp_path):
    session = load_onnx(conv_model(tmp_path / "m.onnx"), "cpu", intra_op_threads=1).session
    x = batch(32)
    placed = ort.OrtValue.ortvalue_from_numpy(x, "cpu", 0)
    outputs = run_bound(session, {"image": placed}, "cpu").get_outputs()
    assert len(outputs) == 1 and outputs[0].device_name() == "cpu"
    assert outputs[0].shape() == [32, CARD.num_classes]
    np.testing.assert_array_equal(outputs[0].numpy(), session.run(None, {"image": x})[0])


def test_a_bound_model_runs_like_a_plain_one(tmp_path, monkeypatch):
    plain = load_onnx(conv_model(tmp_path / "m.onnx"), "cpu", intra_op_threads=1, say=False)
    bound = replace(plain, bind_device="cpu")
    assert bound.io_binding
    seen = count_bound_runs(monkeypatch)
    for n in (1, 300, 7):
        x = batch(n, seed=n)
        np.testing.assert_array_equal(bound.run(x), plain.run(x))
    x = batch(2500)
    np.testing.assert_array_equal(bound.predict_logits(x), plain.predict_logits(x))
    assert seen == [1, 300, 7, 1024, 1024, 452]  # the plain model never binds


# ---------------------------------------------------------------------------- the outputs


def tiny(folder: Path, embedding: bool) -> tuple[Path, dict, np.ndarray, np.ndarray]:
    """A tiny model (one output, or logits + embedding), a batch, and its flat input."""
    path, weights = write_tiny_onnx(folder, CARD, seed=4, embedding=embedding)
    x = batch(6, seed=4)
    return path, weights, x, x.reshape(6, -1)


@pytest.mark.parametrize("bind", [None, "cpu"], ids=["plain", "bound"])
def test_a_one_output_model_still_runs_and_has_no_embedding(tmp_path, bind):
    """A model exported before the embedding output: logits as before, embedding None."""
    path, weights, x, flat = tiny(tmp_path, embedding=False)
    model = replace(load_onnx(path, "cpu", say=False), bind_device=bind)
    assert not model.has_embedding and model.embedding_output is None
    expected = flat @ weights["weight"] + weights["bias"]
    np.testing.assert_allclose(model.run(x), expected, rtol=1e-5, atol=1e-4)
    logits, embedding = model.run_with_embedding(x)
    assert embedding is None
    np.testing.assert_array_equal(logits, model.run(x))


@pytest.mark.parametrize("bind", [None, "cpu"], ids=["plain", "bound"])
def test_run_gives_the_logits_and_run_with_embedding_both(tmp_path, bind):
    path, weights, x, flat = tiny(tmp_path, embedding=True)
    model = replace(load_onnx(path, "cpu", say=False), bind_device=bind)
    assert model.has_embedding and (model.logits_output, model.embedding_output) == (
        "logits",
        "embedding",
    )
    expected = flat @ weights["weight"] + weights["bias"]
    np.testing.assert_allclose(model.run(x), expected, rtol=1e-5, atol=1e-4)
    logits, embedding = model.run_with_embedding(x)
    np.testing.assert_array_equal(logits, model.run(x))
    assert embedding is not None and embedding.shape == (6, 4) and embedding.dtype == np.float32
    np.testing.assert_allclose(embedding, flat @ weights["embedding_weight"], rtol=1e-5, atol=1e-4)


def test_logits_are_found_by_name_not_position(tmp_path):
    """A model whose first output is the embedding still gives logits from ``run``."""
    path, weights, x, flat = tiny(tmp_path, embedding=True)
    proto = onnx.load(str(path))
    outputs = list(proto.graph.output)
    del proto.graph.output[:]
    proto.graph.output.extend(reversed(outputs))
    onnx.save(proto, str(path))
    model = load_onnx(path, "cpu", say=False)
    assert model.session.get_outputs()[0].name == "embedding"
    expected = flat @ weights["weight"] + weights["bias"]
    np.testing.assert_allclose(model.run(x), expected, rtol=1e-5, atol=1e-4)
    _, embedding = model.run_with_embedding(x)
    np.testing.assert_allclose(embedding, flat @ weights["embedding_weight"], rtol=1e-5, atol=1e-4)


def test_a_bound_run_binds_only_the_outputs_asked_for(tmp_path):
    path, _, x, _ = tiny(tmp_path, embedding=True)
    session = load_onnx(path, "cpu", say=False).session
    assert len(run_bound(session, {"input": x}, "cpu").get_outputs()) == 2  # default: all
    only = run_bound(session, {"input": x}, "cpu", outputs=["embedding"]).get_outputs()
    assert len(only) == 1 and only[0].shape() == [6, 4]
    np.testing.assert_array_equal(only[0].numpy(), session.run(["embedding"], {"input": x})[0])


# ---------------------------------------------------------------------------- the users


def test_evaluation_through_the_binding_equals_plain_and_reports_it(tmp_path, monkeypatch):
    onnx_path = conv_model(tmp_path / "m.onnx")
    rng = np.random.default_rng(3)
    # A brightness per image, so the pooled features (and the predictions) differ.
    levels = rng.uniform(0, 255, (203, 1, 1, 1))
    noise = rng.normal(0, 30, (203, *CARD.input_shape))
    images = np.clip(levels + noise, 0, 255).astype(np.uint8)
    labels = rng.integers(0, CARD.num_classes, 203)
    plain = evaluate_onnx(onnx_path, images, labels, 64, device="cpu")
    assert plain["metrics"]["io_binding"] is False
    # What load_onnx would choose on CUDA, on the device this machine has.
    monkeypatch.setattr(sessions, "binding_device", lambda providers: "cpu")
    seen = count_bound_runs(monkeypatch)
    bound = evaluate_onnx(onnx_path, images, labels, 64, device="cpu")
    assert bound["metrics"]["io_binding"] is True and seen == [64, 64, 64, 11]
    np.testing.assert_array_equal(bound["predictions"], plain["predictions"])
    np.testing.assert_array_equal(bound["confidence"], plain["confidence"])
    assert len(set(plain["predictions"].tolist())) >= 2


def test_the_service_through_the_binding_equals_plain_and_reports_it(tmp_path, monkeypatch):
    path, weights = write_tiny_model(tmp_path)
    params = ServeParams(batching=False)
    plain = Predictor.load(path, params, {"model_source": str(path)})
    model = replace(plain.model, bind_device="cpu")
    bound = Predictor(model, plain.sha256, params, model_path=path, provenance={})
    assert plain.describe()["io_binding"] is False and bound.describe()["io_binding"] is True
    assert "with IO binding" in bound.startup_message(Path("params.yaml"))
    seen = count_bound_runs(monkeypatch)
    bound.warm_up()
    pixels = np.random.default_rng(5).integers(0, 256, (9, *plain.card.input_shape))
    pixels = pixels.astype(np.float32)
    got = bound.probabilities(pixels)
    np.testing.assert_array_equal(got, plain.probabilities(pixels))
    assert seen == [1, 9]  # warm-up and the batch; the plain predictor never binds
    x = model_input(pixels, plain.card).reshape(9, -1)
    expected = softmax(x @ weights["weight"] + weights["bias"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_benchmark_times_the_bound_path_beside_the_plain_one(tmp_path, monkeypatch):
    """The CUDA rows' code, on the CPU device: bound row, unbound row, both ratios."""
    from benchmarks.bench_inference import _ort_timings, _row_text

    session = load_onnx(conv_model(tmp_path / "m.onnx"), "cpu", say=False).session
    x = batch(16)
    plain = _ort_timings(session, x, torch_s=1.0, budget=0.01, device="cpu")
    assert plain["ort_io_binding"] is False and "ort_unbound_s" not in plain
    monkeypatch.setattr(sessions, "binding_device", lambda providers: "cpu")
    seen = count_bound_runs(monkeypatch)
    row = _ort_timings(session, x, torch_s=1.0, budget=0.01, device="cpu")
    assert row["ort_io_binding"] is True and seen and set(seen) == {16}
    assert row["ort_over_torch_latency"] == row["ort_s"] > 0
    assert row["ort_unbound_over_torch_latency"] == row["ort_unbound_s"] > 0
    text = _row_text({"device": "cuda", "batch": 16, "torch_s": 1.0, **row})
    assert "ORT-bound/torch" in text and "ORT-unbound/torch" in text


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_session_binds_and_agrees_with_plain_run(tmp_path):
    if CUDA not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider")
    model = load_onnx(conv_model(tmp_path / "m.onnx"), "cuda")
    assert model.provider == CUDA and model.bind_device == "cuda" and model.io_binding
    for n in (1, 1024, 64, 1):
        x = batch(n, seed=n)
        plain = model.session.run(None, {"image": x})[0]
        np.testing.assert_allclose(model.run(x), plain, rtol=1e-5, atol=1e-5)
    # Input already on the device, output left there: what the benchmark times.
    x = batch(256)
    placed = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    out = run_bound(model.session, {"image": placed}, "cuda").get_outputs()[0]
    assert out.device_name().lower() == "cuda"
    np.testing.assert_allclose(
        out.numpy(), model.session.run(None, {"image": x})[0], rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
def test_cuda_binds_the_logits_alone_or_with_the_embedding(tmp_path):
    if CUDA not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider")
    path, _, x, _ = tiny(tmp_path, embedding=True)
    model = load_onnx(path, "cuda")
    assert model.bind_device == "cuda" and model.has_embedding
    plain_logits, plain_embedding = model.session.run(["logits", "embedding"], {"input": x})
    np.testing.assert_allclose(model.run(x), plain_logits, rtol=1e-5, atol=1e-4)
    logits, embedding = model.run_with_embedding(x)
    np.testing.assert_allclose(logits, plain_logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(embedding, plain_embedding, rtol=1e-5, atol=1e-4)
