"""The OpenAPI document (/docs.json), Swagger UI (/docs) and / -> /docs.

In process (Starlette's TestClient on build_app behind the request guard, a tiny ONNX model
as in tests/test_serve_unit.py): the document is valid OpenAPI 3, describes the three
routes with the limits the code enforces, and schemathesis, driven by that document, finds
no 5xx on any operation. One slow test checks the same through a real `bentoml serve`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.modes import GenerationMode
from starlette.testclient import TestClient
from test_serve_unit import CLASSES, PHOTOS, write_tiny_model
from test_serving import model_dir, server, test_set  # noqa: F401  (fixtures, for the slow test)

from trainyard.core.config import ServeParams
from trainyard.serve.app import build_app
from trainyard.serve.guard import RequestGuard
from trainyard.serve.openapi import IMAGE_TYPES, openapi_routes
from trainyard.serve.predictor import Predictor

PARAMS = ServeParams(max_batch_images=4, top_k=2, max_body_bytes=256 * 1024)
ROUTES = {"/classify": "post", "/classify_batch": "post", "/metadata": "get"}
PROBES = ("/healthz", "/livez", "/readyz", "/metrics")
EXAMPLES = 100  # per operation and mode: 5 runs, ~10 s in all on 2 cores
ASSET = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Predictor:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("openapi-model"))
    return Predictor.load(path, PARAMS, {"model_source": str(path)})


@pytest.fixture(scope="module")
def app(predictor):
    """The routes as the service mounts them, behind the guard (no API key)."""
    return RequestGuard(
        build_app(lambda: predictor), api_key=None, max_body_bytes=PARAMS.max_body_bytes
    )


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def doc(client):
    r = client.get("/docs.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


# ---------------------------------------------------------------------------- the document


def test_document_is_valid_openapi_3(doc):
    assert doc["openapi"].startswith("3.")
    schemathesis.openapi.from_dict(doc).validate()  # raises on a document that is not OpenAPI


def test_the_validator_refuses_a_broken_document(doc):
    """The check above can fail: the same document with a wrong type in it is refused."""
    broken = {**doc, "paths": {"/classify": {"post": {"responses": "none"}}}}
    with pytest.raises(Exception, match=r"responses|not of type|object"):
        schemathesis.openapi.from_dict(broken).validate()


def test_document_lists_the_routes_with_their_content_types(doc):
    for path, method in ROUTES.items():
        assert method in doc["paths"][path], path
    for path in PROBES:  # BentoML's, listed too
        assert "get" in doc["paths"][path], path
    classify = doc["paths"]["/classify"]["post"]["requestBody"]["content"]
    assert set(classify) == {"multipart/form-data", *IMAGE_TYPES}
    assert {"image/png", "image/jpeg"} <= set(classify)
    assert classify["multipart/form-data"]["schema"]["required"] == ["image"]
    batch = doc["paths"]["/classify_batch"]["post"]["requestBody"]["content"]
    assert set(batch) == {"multipart/form-data", "application/json"}
    assert batch["application/json"]["schema"]["properties"]["images"]["items"] == {
        "$ref": "#/components/schemas/Pixels"
    }


def test_document_carries_the_real_limits_and_contract(doc):
    """From the worker's ServeParams and the model's card, not from defaults."""
    batch = doc["paths"]["/classify_batch"]["post"]["requestBody"]["content"]
    assert batch["application/json"]["schema"]["properties"]["images"]["maxItems"] == 4
    assert batch["multipart/form-data"]["schema"]["properties"]["images"]["maxItems"] == 4
    top_k = doc["paths"]["/classify"]["post"]["parameters"][0]
    assert top_k["name"] == "top_k" and top_k["schema"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 999_999_999,
        "default": 2,
    }
    schemas = doc["components"]["schemas"]
    assert schemas["Prediction"]["properties"]["label"]["enum"] == list(CLASSES)
    pixels = schemas["Pixels"]  # the tiny model: grayscale 4x4
    assert (pixels["minItems"], pixels["items"]["maxItems"]) == (4, 4)
    assert pixels["items"]["items"] == {"type": "number", "minimum": 0, "maximum": 255}


def test_every_error_answer_has_the_error_shape(doc):
    for path, method in ROUTES.items():
        responses = doc["paths"][path][method]["responses"]
        assert "200" in responses
        errors = [s for s in responses if s[0] in "45"]
        assert errors, path
        for status in errors:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/Error"}, (path, status)
    for status in ("400", "413", "415"):
        assert status in doc["paths"]["/classify"]["post"]["responses"]
        assert status in doc["paths"]["/classify_batch"]["post"]["responses"]
    error = doc["components"]["schemas"]["Error"]
    assert set(error["properties"]) == {"error", "field"} and error["required"] == ["error"]


def test_documented_shapes_match_real_answers(client, doc):
    """A real prediction has every property the document promises, and an error too."""
    schemas = doc["components"]["schemas"]
    r = client.post("/classify", content=PHOTOS[0], headers={"content-type": "image/png"})
    assert r.status_code == 200
    assert set(r.json()) == set(schemas["Prediction"]["properties"])
    r = client.post("/classify_batch", json={"images": [[[0] * 4] * 4] * 5})
    assert r.status_code == 413 and set(r.json()) == {"error", "field"}
    r = client.get("/metadata")
    assert set(schemas["Metadata"]["required"]) <= set(r.json())


def test_an_explicit_predictor_gives_the_same_document(client, predictor, doc):
    from starlette.applications import Starlette

    with TestClient(Starlette(routes=openapi_routes(lambda: predictor))) as own:
        assert own.get("/docs.json").json() == doc


# ---------------------------------------------------------------------------- Swagger UI


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


def test_unknown_asset_is_the_json_404(client):
    r = client.get("/static_content/nope.js")
    assert r.status_code == 404 and set(r.json()) == {"error", "field"}


# ---------------------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def api_schema(app):
    """The document as schemathesis reads it from the app (the probes are BentoML's, not
    in this app, so only the three routes are fuzzed)."""
    return schemathesis.openapi.from_asgi("/docs.json", app)


# schemathesis' own pytest integration (from_fixture(...).parametrize()) breaks on pytest 9
# (it sets request.node._nodeid), so each operation and mode is a Hypothesis test here.
@pytest.mark.parametrize(
    ("path", "mode"),
    [
        *((path, mode) for path in ("/classify", "/classify_batch") for mode in GenerationMode),
        ("/metadata", GenerationMode.POSITIVE),  # no parameters: nothing to make invalid
    ],
    ids=lambda v: getattr(v, "value", v),
)
def test_no_input_gets_a_server_error(api_schema, path, mode):
    operation = api_schema[path][ROUTES[path].upper()]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case) -> None:
        # No 5xx, and every answer is one the document lists, in the documented shape.
        case.call_and_validate(
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance]
        )

    fuzz()


# ---------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_docs_under_bentoml_serve(server):  # noqa: F811  (the fixture imported above)
    doc = requests.get(f"{server.url}/docs.json", timeout=10).json()
    for path, method in ROUTES.items():
        assert method in doc["paths"][path], path
    page = requests.get(f"{server.url}/docs", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ASSET.findall(page.text):
        r = requests.get(f"{server.url}/{asset.removeprefix('./')}", timeout=10)
        assert r.status_code == 200 and r.content, asset
    home = requests.get(f"{server.url}/", timeout=10)
    assert home.status_code == 200 and Path(home.url).name == "docs"
    assert requests.get(f"{server.url}/readyz", timeout=10).status_code == 200
