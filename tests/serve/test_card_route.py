"""GET /card in process (bento/service.py's app on a tiny model, one for the module): the card
beside the model as Markdown or JSON by ?format= or Accept, /metadata naming it, and a model
without one answered with a 404 that says so."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from test_ui import client, model  # noqa: F401 - the demo page's app on a tiny model

from trainyard.runtime.model_file import card_beside
from trainyard.serve.card_page import card_format

CARD_MD = "# Model card: tiny\n\n| class | F1 |\n|---|---|\n| a | 0.5 |\n"
CARD_JSON = {"schema": 1, "name": "tiny", "quality": {"test": {"accuracy": 0.5}}}


@pytest.fixture
def with_card(model) -> Iterator[None]:  # noqa: F811
    """The card beside the model, as evaluate writes it; removed again after the test."""
    card_beside(model, "md").write_text(CARD_MD, encoding="utf-8")
    card_beside(model, "json").write_text(json.dumps(CARD_JSON), encoding="utf-8")
    yield
    for kind in ("md", "json"):
        card_beside(model, kind).unlink()


def test_a_model_without_a_card_is_a_clear_404(client):  # noqa: F811
    resp = client.get("/card")
    assert resp.status_code == 404
    assert resp.json()["error"].startswith("no card for this model: model.card.md is not beside")
    assert client.get("/card?format=json").status_code == 404
    meta = client.get("/metadata").json()
    assert meta["card"] is None and "GET /card" in meta["endpoints"]


def test_the_card_is_markdown_by_default_and_json_when_asked(client, with_card):  # noqa: F811
    md = client.get("/card")
    assert md.status_code == 200 and md.text == CARD_MD
    assert md.headers["content-type"] == "text/markdown; charset=utf-8"
    for ask in ({"params": {"format": "json"}}, {"headers": {"Accept": "application/json"}}):
        resp = client.get("/card", **ask)
        assert resp.status_code == 200, ask
        assert resp.headers["content-type"] == "application/json" and resp.json() == CARD_JSON
    # ?format wins over the header; a browser's Accept (text/html first) gets Markdown.
    forced = client.get("/card?format=md", headers={"Accept": "application/json"})
    assert forced.text == CARD_MD
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    assert client.get("/card", headers={"Accept": browser}).text == CARD_MD
    bad = client.get("/card?format=xml")
    assert bad.status_code == 400 and bad.json()["field"] == "format"
    assert client.get("/metadata").json()["card"] == "/card"


def test_an_unknown_paths_404_lists_the_card(client):  # noqa: F811
    resp = client.get("/no-such-page")
    assert resp.status_code == 404 and "GET /card" in resp.json()["error"]


@pytest.mark.parametrize(
    ("query", "accept", "kind"),
    [
        (None, "", "md"),
        (None, "application/json", "json"),
        (None, "text/markdown, application/json", "md"),
        (None, "application/json;q=0.9, text/markdown", "md"),  # by q
        (None, "text/markdown;q=0.5, application/json;q=0.8", "json"),
        (None, "application/json;q=0", "md"),  # q=0: not acceptable
        ("JSON", "text/markdown", "json"),
        ("markdown", "application/json", "md"),
        ("yaml", "", None),
    ],
)
def test_card_format(query, accept, kind):
    assert card_format(query, accept) == kind


def test_an_int8_models_card_is_its_fp32_models(tmp_path):
    assert card_beside(tmp_path / "model.int8.onnx", "json") == tmp_path / "model.card.json"
    assert card_beside(tmp_path / "model.onnx", "md") == tmp_path / "model.card.md"


def test_a_registry_models_card_is_fetched_beside_it_or_said_missing(tmp_path, caplog):
    """Serving models:/...: start-up (and each swap) asks the registry for both cards, into
    the cache where the version's model.onnx lands; a version without one is a log line."""
    from types import SimpleNamespace

    from trainyard.core.errors import TrackingError
    from trainyard.core.model_ref import parse_model_ref
    from trainyard.serve.startup import Startup

    ref, asked = parse_model_ref("models:/clf/2", "serve.model"), []

    class Registry:
        def fetch_card(self, got, cache, kind):
            asked.append((got, cache, kind))
            if got.version == "3":
                raise TrackingError(f"{got} (v3) has no model card")
            return tmp_path

    begun = SimpleNamespace(registry=Registry(), settings=SimpleNamespace(cache_dir=tmp_path))
    Startup.fetch_card(begun, ref)  # type: ignore[arg-type]
    assert asked == [(ref, tmp_path, "json"), (ref, tmp_path, "md")]
    with caplog.at_level("INFO", logger="bentoml.serve.trainyard"):
        Startup.fetch_card(begun, parse_model_ref("models:/clf/3", "serve.model"))  # type: ignore[arg-type]
    assert "models:/clf/3: no model card for GET /card" in caplog.text
    Startup.fetch_card(SimpleNamespace(registry=None), ref)  # type: ignore[arg-type]  # a bento
