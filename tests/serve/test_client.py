"""BentoML's own client, ``bentoml.SyncHTTPClient``, against a real `bentoml serve`: the
prediction endpoints are ``@bentoml.api`` methods, so it knows them by name and sends what
they take (an image file as a multipart part, options as form fields).

    client = bentoml.SyncHTTPClient("http://127.0.0.1:3000", token=key)
    client.classify(image=Path("shoe.png"), top_k=3)
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import bentoml
import numpy as np
import pytest
import test_serving
from bentoml.exceptions import BentoMLException, InvalidArgument
from PIL import Image
from test_serving import API_KEY, png

from trainyard.core.io import sha256_file

# test_serving's module-scoped fixtures, used here by name (two servers of conftest's model).
offline, server, keyed_server = test_serving.offline, test_serving.server, test_serving.keyed_server

pytestmark = pytest.mark.slow


def image_files(folder: Path, images: np.ndarray) -> list[Path]:
    paths = []
    for i, img in enumerate(images):
        paths.append(folder / f"img{i}.png")
        paths[-1].write_bytes(png(img))
    return paths


def test_classify_by_name_gives_the_apis_answer(server, test_set, offline, tmp_path, model_dir):
    """A path and a PIL image, each the same answer as ONNX Runtime offline and as the API
    answers a plain multipart upload."""
    [path] = image_files(tmp_path, test_set[0][:1])
    with bentoml.SyncHTTPClient(server.url) as client:
        by_path = client.classify(image=path)
        by_pil = client.classify(image=Image.open(path), top_k=3)
    plain = test_serving.classify(server.url, path.read_bytes()).json()
    assert by_path == plain
    assert np.allclose(by_path["probabilities"], offline[0], atol=1e-5)
    assert by_path["class_id"] == int(offline[0].argmax())
    assert by_pil["probabilities"] == by_path["probabilities"]
    assert [t["class_id"] for t in by_pil["top_k"]] == [int(i) for i in np.argsort(-offline[0])[:3]]
    assert by_path["model_version"] == sha256_file(model_dir / "model.onnx")[:12]


def test_invert_and_batch_by_name(server, test_set, tmp_path):
    paths = image_files(tmp_path, test_set[0][:5])
    inverted = tmp_path / "inverted.png"
    inverted.write_bytes(png(255 - test_set[0][0]))
    with bentoml.SyncHTTPClient(server.url) as client:
        batch = client.classify_batch(images=paths, top_k=1)
        singles = [client.classify(image=p) for p in paths]
        back = client.classify(image=inverted, invert=True)
    assert [b["probabilities"] for b in batch] == [s["probabilities"] for s in singles]
    assert all(len(b["top_k"]) == 1 for b in batch)
    assert np.allclose(back["probabilities"], singles[0]["probabilities"], atol=1e-6)


def test_metadata_by_name(server, model_dir):
    with bentoml.SyncHTTPClient(server.url) as client:
        meta = client.metadata()
    assert meta["model"]["sha256"] == sha256_file(model_dir / "model.onnx")
    assert meta["classes"][0] == "T-shirt/top" and meta["input"]["image"] == "28x28"


def test_a_refusal_raises_with_the_servers_json(server, tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image\n")
    with bentoml.SyncHTTPClient(server.url) as client, pytest.raises(InvalidArgument) as err:
        client.classify(image=text)
    assert err.value.error_code == 400
    body = json.loads(err.value.message)
    assert body["field"] == "image" and body["error"].startswith("image: not an image")


def test_the_api_key_is_the_clients_token(keyed_server, test_set, offline, tmp_path):
    [path] = image_files(tmp_path, test_set[0][:1])
    # Without the key the client cannot even read the endpoints (/schema.json is guarded).
    with pytest.raises(BentoMLException, match="Failed to fetch schema"):
        bentoml.SyncHTTPClient(keyed_server.url)
    with bentoml.SyncHTTPClient(keyed_server.url, token=API_KEY) as client:
        answer = client.classify(image=path)
    assert np.allclose(answer["probabilities"], offline[0], atol=1e-5)


def test_explain_by_name_adds_a_heatmap_the_size_of_the_upload(server, test_set, tmp_path):
    """The batching server: an explaining request is answered unbatched, with the plain
    answer's fields unchanged and a PNG of the upload's own width and height."""
    [path] = image_files(tmp_path, test_set[0][:1])
    wide = tmp_path / "wide.png"
    Image.fromarray(test_set[0][1]).resize((90, 60)).save(wide)
    with bentoml.SyncHTTPClient(server.url) as client:
        plain = client.classify(image=path)
        explained = client.classify(image=path, explain=True)
        stretched = client.classify(image=wide, explain=True)
    assert "heatmap" not in plain
    assert {k: v for k, v in explained.items() if k != "heatmap"} == plain
    heat = Image.open(io.BytesIO(base64.b64decode(explained["heatmap"])))
    assert (heat.format, heat.size) == ("PNG", (28, 28)) and "transparency" in heat.info
    assert np.asarray(heat.convert("RGBA"))[..., 3].max() == 255  # the hottest: opaque
    assert Image.open(io.BytesIO(base64.b64decode(stretched["heatmap"]))).size == (90, 60)


def test_explain_on_the_unbatched_server_and_a_bad_value(keyed_server, test_set):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    data = png(test_set[0][2])
    url = keyed_server.url
    plain = test_serving.classify(url, data, headers=auth).json()
    explained = test_serving.classify(url, data, headers=auth, explain="true").json()
    assert {k: v for k, v in explained.items() if k != "heatmap"} == plain
    assert Image.open(io.BytesIO(base64.b64decode(explained["heatmap"]))).size == (28, 28)
    bad = test_serving.classify(url, data, headers=auth, explain="sometimes")
    assert bad.status_code == 400 and bad.json()["field"] == "explain", bad.text
