"""BentoML's own description of the service: the OpenAPI document (/docs.json), the schema
its client reads (/schema.json), the Swagger UI page (/docs) and / -> /docs.

The prediction endpoints are ``@bentoml.api`` methods, so these are BentoML's documents, not
hand-written ones. In process (bento/service.py as BentoML's ASGI app, a tiny ONNX model
as in tests/serve/test_serve_unit.py), then one slow test through a real `bentoml serve`.
tests/serve/test_client.py calls the endpoints with ``bentoml.SyncHTTPClient``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from starlette.testclient import TestClient
from test_serve_unit import CLASSES, PHOTOS, service_client, write_tiny_model
from test_serving import server  # noqa: F401  (a fixture, for the slow test; model_dir: conftest)

ENDPOINTS = {"/classify", "/classify_batch", "/metadata"}  # POST, BentoML api methods
PROBES = ("/healthz", "/livez", "/readyz", "/metrics")
ASSET = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[TestClient]:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("openapi-model"))
    yield from service_client(path, max_batch_images=4, top_k=2, batching=False)


@pytest.fixture(scope="module")
def doc(client) -> dict:
    r = client.get("/docs.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def test_document_lists_the_endpoints_and_the_probes(doc):
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) >= ENDPOINTS
    for path in ENDPOINTS:
        assert set(doc["paths"][path]) == {"post"}, path
    for path in PROBES:  # BentoML's own
        assert "get" in doc["paths"][path], path
    # Batching is off here, so the internal batchable method is not defined at all.
    assert "/probabilities" not in doc["paths"]


def test_request_bodies_name_the_fields_users_send(doc):
    classify = doc["paths"]["/classify"]["post"]
    form = classify["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["image"] and set(form["properties"]) == {
        "image",
        "top_k",
        "invert",
        "explain",
    }
    assert form["properties"]["image"]["format"] == "binary"
    assert "image/png" in classify["description"]  # the raw-body form, in words
    batch = doc["paths"]["/classify_batch"]["post"]["requestBody"]["content"]
    images = batch["multipart/form-data"]["schema"]["properties"]["images"]
    assert images["type"] == "array" and images["items"]["format"] == "binary"


def test_documented_answer_matches_a_real_answer(client, doc):
    ok = doc["paths"]["/classify"]["post"]["responses"]["200"]["content"]["application/json"]
    documented = ok["schema"]
    r = client.post("/classify", content=PHOTOS[0], headers={"content-type": "image/png"})
    assert r.status_code == 200
    assert set(r.json()) == set(documented["required"])
    # Every field is in every answer, but the heatmap: only with explain (test_explain_unit).
    assert set(documented["properties"]) - set(documented["required"]) == {"heatmap"}
    assert r.json()["label"] in CLASSES and len(r.json()["top_k"]) == 2  # serve.top_k here


def test_the_client_schema_has_a_file_field_so_bentoml_client_sends_multipart(client):
    routes = {r["name"]: r for r in client.get("/schema.json").json()["routes"]}
    assert set(routes) == {"classify", "classify_batch", "metadata"}
    image = routes["classify"]["input"]["properties"]["image"]
    assert image["type"] == "file"  # what bentoml.SyncHTTPClient uploads as a file part
    images = routes["classify_batch"]["input"]["properties"]["images"]
    assert images["type"] == "array" and images["items"]["type"] == "file"
    assert routes["classify"]["route"] == "/classify"


def test_docs_page_loads_only_local_assets(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assets = ASSET.findall(r.text)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        assert "//" not in asset and not asset.startswith(("http:", "https:")), asset
        url = "/" + asset.removeprefix("./")
        assert client.get(url).status_code == 200, url
    initializer = client.get("/static_content/swagger-initializer.js").text
    assert 'url: "./docs.json"' in initializer  # the page asks /docs.json, relative to /docs


def test_root_redirects_to_the_docs(client):
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "./docs"
    assert client.get("/").url.path == "/docs"


@pytest.mark.slow
def test_docs_under_bentoml_serve(server):  # noqa: F811  (the fixture imported above)
    doc = requests.get(f"{server.url}/docs.json", timeout=10).json()
    assert set(doc["paths"]) >= ENDPOINTS
    # test_serving's server batches, in one hop: /classify is the batchable method, with
    # the same fields as unbatched, and no other route is listed.
    assert "/probabilities" not in doc["paths"]
    form = doc["paths"]["/classify"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert {"image", "top_k", "invert"} <= set(form["schema"]["properties"])
    page = requests.get(f"{server.url}/docs", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ASSET.findall(page.text):
        r = requests.get(f"{server.url}/{asset.removeprefix('./')}", timeout=10)
        assert r.status_code == 200 and r.content, asset
    home = requests.get(f"{server.url}/", timeout=10)
    assert home.status_code == 200 and Path(home.url).name == "docs"
    assert requests.get(f"{server.url}/readyz", timeout=10).status_code == 200
