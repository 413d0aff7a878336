"""The demo page's routes in process (bento/service.py as BentoML's app, a tiny model):
each file answers with its content type, the page needs nothing from another origin (and
asks for no /favicon.ico), and the guard leaves it open when an API key is set.
tests/serve/test_ui_browser.py drives the page in a real browser against `bentoml serve`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
from starlette.testclient import TestClient
from test_serve_unit import service_client, write_tiny_model

from trainyard.serve.ui_routes import ASSETS, read_asset

KEY = "ui-test-key"
PAGE = {"/ui": "text/html", "/ui/ui.js": "text/javascript", "/ui/ui.css": "text/css"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("ui-model"))
    return path


@pytest.fixture(scope="module")
def client(model) -> Iterator[TestClient]:
    yield from service_client(model, batching=False)


@pytest.fixture(scope="module")
def keyed_client(model) -> Iterator[TestClient]:
    yield from service_client(model, api_key=KEY, batching=False)


class References(HTMLParser):
    """Every URL the HTML loads or links to (src, href, action, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "action", "srcset", "poster", "data") and value:
                self.urls.append(value)


def test_page_and_assets_answer_with_their_content_types(client):
    for path, media_type in PAGE.items():
        resp = client.get(path)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"] == f"{media_type}; charset=utf-8", path
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert "default-src 'self'" in resp.headers["content-security-policy"]
        assert resp.content == read_asset(path.removeprefix("/ui").lstrip("/") or "index.html")
        head = client.head(path)
        assert head.status_code == 200 and head.content == b"", path
    assert set(ASSETS) == {"index.html", "ui.js", "ui.css"}


def test_page_references_only_its_own_assets(client):
    html = client.get("/ui").text
    parser = References()
    parser.feed(html)
    # The icon is inline: the browser asks for no /favicon.ico (a 404 in its console).
    assert sorted(parser.urls) == ["data:,", "ui/ui.css", "ui/ui.js"]
    for url in (u for u in parser.urls if u != "data:,"):
        resolved = urljoin("http://testserver/ui", url)
        parts = urlsplit(resolved)
        assert parts.netloc == "testserver", url
        assert client.get(parts.path).status_code == 200, resolved
    # Nothing in any of the three files points at another origin (no CDN, no fonts).
    for name in ASSETS:
        text = read_asset(name).decode()
        assert "http://" not in text and "https://" not in text, name
        assert "@import" not in text, name
    # The page calls the service's API with URLs relative to it (works behind a prefix).
    js = read_asset("ui.js").decode()
    assert re.search(r'fetch\("metadata"', js) and re.search(r"fetch\(`classify\?", js)


def test_trailing_slash_redirects_to_the_page_and_other_paths_are_json_404(client):
    resp = client.get("/ui/", follow_redirects=False)
    assert resp.status_code == 308
    assert urljoin("http://testserver/ui/", resp.headers["location"]) == "http://testserver/ui"
    assert client.get("/ui/").url.path == "/ui"
    for path in ("/ui/index.html", "/ui/../pyproject.toml", "/ui/nope.js"):
        missing = client.get(path)
        assert missing.status_code == 404, path
        assert missing.json()["field"] is None
    assert client.post("/ui", content=b"x").status_code == 404  # the page is GET only


def test_page_is_open_without_the_key_and_the_api_is_not(keyed_client):
    for path in PAGE:
        assert keyed_client.get(path).status_code == 200, path
    refused = keyed_client.get("/metadata")
    assert refused.status_code == 401 and refused.json()["field"] == "Authorization"
    auth = {"Authorization": f"Bearer {KEY}"}
    meta = keyed_client.get("/metadata", headers=auth).json()
    # What the page's model card shows is in the metadata it reads.
    assert meta["classes"] == ["cat", "dog", "bird"]
    assert meta["input"]["image"] == "4x4" and meta["input"]["resize"] == "stretch"
    assert {"version", "mlflow_run_id", "data_sha256"} <= set(meta["model"])
    assert {"mlflow_run_id", "data_version"} <= set(meta["source"])
    assert meta["input"]["top_k"] >= 1
