"""The demo page at /ui in a real browser: headless Chromium (Debian's chromium and
chromium-driver, which .ci/run installs) driven by Selenium against a real `bentoml serve`.

A real Fashion-MNIST test image goes in through the page's file input; the page must show
the label and probabilities that the API itself gives for the same file, and the model card
from /metadata. A text file must show the API's own error message. With an API key set, the
page asks for it, sends it as a Bearer token, and an image dropped on the page is classified.

No Chromium is a failure, not a skip: CI installs it, and a skipped browser test would let
the page break unseen. TRAINYARD_CHROMIUM / TRAINYARD_CHROMEDRIVER point elsewhere.
TRAINYARD_UI_SCREENSHOT=docs/img/ui.png saves the page after a prediction (the docs'
screenshot); by default nothing is written into the repository.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from test_serving import API_KEY, keyed_server, server  # noqa: F401

from trainyard.evaluation.card_text import card_markdown
from trainyard.evaluation.model_card import build_card, with_registration
from trainyard.runtime.model_file import card_beside

from conftest import REPO, fashion_card

pytestmark = pytest.mark.slow

CHROMIUM = Path(os.environ.get("TRAINYARD_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("TRAINYARD_CHROMEDRIVER", "/usr/bin/chromedriver"))
WAIT_S = 20


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[WebDriver]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        pytest.fail(
            f"the browser test needs headless Chromium; not found: {', '.join(missing)}. "
            "Install Debian's chromium and chromium-driver (apt-get install chromium "
            "chromium-driver, as .ci/run does) or set TRAINYARD_CHROMIUM and "
            "TRAINYARD_CHROMEDRIVER."
        )
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # containers and CI run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1200,860",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    log = tmp_path_factory.mktemp("chromedriver") / "chromedriver.log"
    try:
        driver = webdriver.Chrome(
            service=Service(str(CHROMEDRIVER), log_output=str(log)), options=options
        )
    except WebDriverException as err:
        pytest.fail(f"{CHROMEDRIVER} could not start {CHROMIUM}: {err.msg}")
    try:
        yield driver
    finally:
        driver.quit()


# ---------------------------------------------------------------------------- helpers


def wait_for(driver: WebDriver, what: str, condition) -> object:
    """``condition(driver)`` once truthy, or a failure naming ``what`` and the page state."""
    try:
        return WebDriverWait(driver, WAIT_S).until(condition)
    except TimeoutException:
        status = driver.find_element(By.ID, "status").text
        error = driver.find_element(By.ID, "error").text
        pytest.fail(f"page never showed {what} (status: {status!r}, error: {error!r})")


def field(driver: WebDriver, name: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'#card dd[data-field="{name}"]').text


def bars(driver: WebDriver) -> list[dict]:
    return [
        {
            "label": li.get_attribute("data-label"),
            "class_id": int(li.get_attribute("data-class-id")),
            "probability": float(li.get_attribute("data-probability")),
            "shown_label": li.find_element(By.CLASS_NAME, "label").text,
            "shown": li.find_element(By.CLASS_NAME, "probability").text,
        }
        for li in driver.find_elements(By.CSS_SELECTOR, "#results li.bar")
    ]


def check_bars(driver: WebDriver, expected: dict) -> None:
    """The bars are the API's top_k: labels in order, probabilities exact, text rounded."""
    got = bars(driver)
    assert [b["label"] for b in got] == [t["label"] for t in expected["top_k"]]
    assert [b["shown_label"] for b in got] == [t["label"] for t in expected["top_k"]]
    for bar, want in zip(got, expected["top_k"], strict=True):
        assert bar["class_id"] == want["class_id"]
        assert bar["probability"] == want["probability"], bar
        shown = float(bar["shown"].rstrip("%"))
        assert bar["shown"].endswith("%") and abs(shown - 100 * want["probability"]) <= 0.051
    assert got[0]["label"] == expected["label"]


def no_policy_violations(driver: WebDriver) -> list[dict]:
    """The page's Content-Security-Policy blocked nothing (it needs nothing from elsewhere).
    Returns the console's entries (reading them empties the browser's log)."""
    logs = driver.get_log("browser")
    blocked = [e["message"] for e in logs if "Content Security Policy" in e["message"]]
    assert blocked == [], blocked
    return logs


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def api_classify(url: str, name: str, data: bytes, mime: str, top_k: int, **headers) -> dict:
    resp = requests.post(
        f"{url}/classify",
        params={"top_k": top_k},
        files={"image": (name, data, mime)},
        headers=headers,
        timeout=30,
    )
    return {"status": resp.status_code, **resp.json()}


def confident_image(url: str, test_data: tuple[np.ndarray, np.ndarray]) -> bytes:
    """A real test image the model gets right with the highest probability, of the first
    24 (the model has trained for a few steps only): a page worth a screenshot."""
    images, labels = test_data
    best, best_p = png_bytes(images[0]), -1.0
    for img, label in zip(images[:24], labels[:24], strict=True):
        data = png_bytes(img)
        pred = api_classify(url, "x.png", data, "image/png", 1)
        p = pred["top_k"][0]["probability"]
        if pred["class_id"] == int(label) and p > best_p:
            best, best_p = data, p
    return best


# ---------------------------------------------------------------------------- the page


def test_page_shows_the_apis_answer_for_an_uploaded_test_image(
    server,  # noqa: F811
    test_set,
    browser,
    tmp_path,
):
    meta = requests.get(f"{server.url}/metadata", timeout=10).json()
    top_k = meta["input"]["top_k"]
    image = tmp_path / "fashion-test-image.png"
    image.write_bytes(confident_image(server.url, test_set))
    expected = api_classify(server.url, image.name, image.read_bytes(), "image/png", top_k)
    assert expected["status"] == 200, expected

    browser.get(f"{server.url}/ui")
    assert browser.title == "trainyard classifier"
    wait_for(browser, "the model card", lambda d: field(d, "model version"))
    # The model card is /metadata's.
    assert field(browser, "model version") == meta["model"]["version"]
    assert field(browser, "MLflow run") == "run-for-serving-tests"
    assert field(browser, "data version") == meta["source"]["data_version"] == "d" * 64
    assert field(browser, "input size") == "28x28" and field(browser, "resize policy") == "pad"
    classes = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#classes li")]
    assert classes == meta["classes"]
    assert not browser.find_element(By.ID, "key-row").is_displayed()  # no key on this server
    # This model has no card beside it: the panel says so, without a failed request.
    assert meta["card"] is None
    assert browser.find_element(By.ID, "model-card").text == "no card for this model"

    browser.find_element(By.ID, "file").send_keys(str(image))
    wait_for(browser, f"{top_k} bars", lambda d: len(bars(d)) == top_k)
    check_bars(browser, expected)
    assert expected["label"] in browser.find_element(By.ID, "status").text
    assert not browser.find_element(By.ID, "error").is_displayed()
    preview = browser.find_element(By.ID, "preview")
    natural_width = "return arguments[0].complete && arguments[0].naturalWidth"
    wait_for(browser, "the preview", lambda d: d.execute_script(natural_width, preview) == 28)
    assert preview.is_displayed()
    # No console error at all: no failed request (the icon is inline: no /favicon.ico).
    errors = [e["message"] for e in no_policy_violations(browser) if e["level"] == "SEVERE"]
    assert errors == [], errors

    target = os.environ.get("TRAINYARD_UI_SCREENSHOT")
    if target:
        path = Path(target) if Path(target).is_absolute() else REPO / target
        path.parent.mkdir(parents=True, exist_ok=True)
        height = browser.execute_script("return document.documentElement.scrollHeight")
        metrics = {"width": 1200, "height": int(height), "deviceScaleFactor": 1, "mobile": False}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # whole page
        try:
            assert browser.save_screenshot(str(path)), path
        finally:
            browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_page_shows_the_apis_message_for_a_file_that_is_no_image(server, browser, tmp_path):  # noqa: F811
    text = tmp_path / "notes.txt"
    text.write_text("these are notes, not a photo\n")
    expected = api_classify(server.url, text.name, text.read_bytes(), "text/plain", 5)
    assert 400 <= expected["status"] < 500 and expected["error"], expected

    browser.get(f"{server.url}/ui")
    wait_for(browser, "the model card", lambda d: field(d, "model version"))
    browser.find_element(By.ID, "file").send_keys(str(text))
    error = browser.find_element(By.ID, "error")
    wait_for(browser, "an error", lambda d: error.is_displayed() and error.text)
    assert expected["error"] in error.text
    if expected.get("field"):
        assert f"(field: {expected['field']})" in error.text
    assert bars(browser) == []
    assert not browser.find_element(By.ID, "preview").is_displayed()  # not an image


def test_page_asks_for_the_key_and_classifies_a_dropped_image(
    keyed_server,  # noqa: F811
    test_set,
    browser,
):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    refused = requests.get(f"{keyed_server.url}/metadata", timeout=10).json()
    data = png_bytes(test_set[0][5])
    expected = api_classify(keyed_server.url, "dropped.png", data, "image/png", 5, **auth)
    assert expected["status"] == 200, expected

    browser.get(f"{keyed_server.url}/ui")  # the page itself needs no key
    key_row = browser.find_element(By.ID, "key-row")
    wait_for(browser, "the API key field", lambda d: key_row.is_displayed())
    assert refused["error"] in browser.find_element(By.ID, "error").text
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "key-apply").click()
    wait_for(browser, "the model card", lambda d: field(d, "model version"))
    assert not browser.find_element(By.ID, "error").is_displayed()

    # Drag and drop: a drop event carrying the file, as a browser makes it from a drag.
    browser.execute_script(
        """
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "dropped.png", { type: "image/png" }));
        const drop = document.getElementById("drop");
        for (const type of ["dragenter", "dragover", "drop"]) {
          drop.dispatchEvent(
            new DragEvent(type, { dataTransfer: transfer, bubbles: true, cancelable: true })
          );
        }
        """,
        base64.b64encode(data).decode(),
    )
    wait_for(browser, "5 bars", lambda d: len(bars(d)) == 5)
    check_bars(browser, expected)
    no_policy_violations(browser)


def test_explain_overlays_the_heatmap_on_the_uploaded_image(server, test_set, browser, tmp_path):  # noqa: F811
    image = tmp_path / "explain-me.png"
    image.write_bytes(png_bytes(test_set[0][3]))
    browser.get(f"{server.url}/ui")
    wait_for(browser, "the model card", lambda d: field(d, "model version"))
    toggle = browser.find_element(By.ID, "explain")
    assert toggle.is_enabled()  # /metadata says this model explains
    toggle.click()
    browser.find_element(By.ID, "file").send_keys(str(image))
    wait_for(browser, "bars", lambda d: len(bars(d)) > 0)
    heat = browser.find_element(By.ID, "heatmap")
    natural = (
        "return arguments[0].complete && [arguments[0].naturalWidth, arguments[0].naturalHeight]"
    )
    wait_for(
        browser, "the heatmap", lambda d: heat.is_displayed() and d.execute_script(natural, heat)
    )
    assert browser.execute_script(natural, heat) == [28, 28]  # the upload's size
    assert heat.rect == browser.find_element(By.ID, "preview").rect  # laid on the preview
    # Off again: the next answer has no heatmap, and none is shown.
    toggle.click()
    wait_for(browser, "the heatmap gone", lambda d: not heat.is_displayed() and len(bars(d)) > 0)


# ---------------------------------------------------------------------------- the model card


def made_up_card(sha256: str) -> dict:
    """A model card for the served Fashion-MNIST model, from made-up scores (evaluate's
    builder: tests/evaluation/test_model_card.py checks what it says)."""
    dataset = fashion_card()
    classes = list(dataset.classes)
    k = len(classes)
    cm = [[90 if i == j else (8 if (i, j) == (6, 0) else 0) for j in range(k)] for i in range(k)]
    per_class = {
        c: {"precision": 0.9, "recall": 0.9 - (0.1 if i == 6 else 0), "f1": 0.9 - i / 100}
        | {"support": sum(cm[i])}
        for i, c in enumerate(classes)
    }
    card = build_card(
        name="fashion-mnist-classifier",
        metadata={"arch": "cnn", "pretrained": "{}"},
        dataset=dataset,
        scores={"per_class": per_class, "confusion_matrix": cm},
        metrics={
            "test": {"accuracy": 0.9012, "macro_f1": 0.8955, "samples": 908},
            "calibration": {"temperature": 0.62, "ece": 0.014, "ece_uncalibrated": 0.092},
            "explain": {
                "deletion_drop_top20": 0.12,
                "deletion_drop_random20": 0.08,
                "deletion_ratio": 1.5,
                "passed": False,
                "occlusion_ceiling_ratio": 1.57,
                "occlusion_map_ratio": 0.99,
                "occlusion_grid": "7x7",
                "occlusion_samples": 64,
            },
        },
        train={"run_id": "run-for-serving-tests", "epochs_run": 1, "best_epoch": 1},
        onnx_sha256=sha256,
        lineage={"git_commit": "c0ffee" * 6, "git_dirty": "false", "data_version": "a.dir"},
        recipe={},
        params={},
    )
    reg = {"model_name": "fashion-mnist-classifier", "version": 4, "alias": "champion"}
    return with_registration(card, reg | {"reason": "first"})


@pytest.fixture
def carded(server, model_dir) -> Iterator[dict]:  # noqa: F811
    """The served model with its card beside it (as evaluate leaves models/), removed after."""
    meta = requests.get(f"{server.url}/metadata", timeout=10).json()
    card = made_up_card(meta["model"]["sha256"])
    paths = {kind: card_beside(model_dir / "model.onnx", kind) for kind in ("md", "json")}
    paths["md"].write_text(card_markdown(card), encoding="utf-8")
    paths["json"].write_text(json.dumps(card), encoding="utf-8")
    try:
        yield card
    finally:
        for path in paths.values():
            path.unlink()


def test_the_card_panel_shows_the_models_card(server, carded, browser):  # noqa: F811
    browser.get(f"{server.url}/ui")
    panel = browser.find_element(By.ID, "model-card")
    wait_for(browser, "the card's tables", lambda d: panel.find_elements(By.TAG_NAME, "table"))
    headings = [h.text for h in panel.find_elements(By.TAG_NAME, "h3")]
    assert headings == [
        "How good it is",
        "Where it is weak",
        "What it learned from",
        "What the model is",
    ]
    text = panel.text
    assert "0.9012 on 908 images" in text and "0.0140 at temperature 0.620" in text
    assert "failed: top 20% -12.0%, random 20% -8.0%" in text
    assert "the map 0.99x, the ceiling 1.57x at 7x7 on 64 images" in text
    # The per-class table: one row per class, the weakest confusion (Shirt taken for T-shirt).
    tables = panel.find_elements(By.TAG_NAME, "table")
    per_class = tables[1].find_elements(By.CSS_SELECTOR, "tbody tr")
    assert [r.find_element(By.TAG_NAME, "td").text for r in per_class] == carded["data"]["classes"]
    confused = tables[2].find_element(By.CSS_SELECTOR, "tbody tr").text
    assert confused.startswith("Shirt T-shirt/top 8")
    assert "fashion-mnist-classifier v4 (champion at registration)" in text
    assert "trained from scratch" in text
    links = {a.text: a.get_attribute("href") for a in panel.find_elements(By.TAG_NAME, "a")}
    assert links == {
        "the whole card (Markdown)": f"{server.url}/card",
        "JSON": f"{server.url}/card?format=json",
    }
    errors = [e["message"] for e in no_policy_violations(browser) if e["level"] == "SEVERE"]
    assert errors == [], errors
