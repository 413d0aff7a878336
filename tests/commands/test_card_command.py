"""``trainyard card REF`` on a sqlite MLflow registry (conftest's ``mlflow_db``): a version
registered as evaluate registers it, its card logged in its run and written as its
description; by alias, number, run and path, Markdown and JSON; a model without a card is
exit 1 with a message saying so. And the description cut to fit the registry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainyard import cli
from trainyard.core.io import sha256_file
from trainyard.runtime.model_file import card_beside
from trainyard.track.version_card import MAX_DESCRIPTION, description_of

from conftest import fashion_card, write_tiny_onnx

CARD_MD = "# Model card: cards\n\n## What the model is\n\n| | |\n|---|---|\n| arch | cnn |\n"
CARD_JSON = {"schema": 1, "name": "cards", "model": {"arch": "cnn"}}


@pytest.fixture(scope="module")
def registered(mlflow_db, tmp_path_factory):
    """v1 of "cards" with its card (logged as evaluate logs it, and its description); v2
    from a run evaluated before cards: (tracking URI, run ids, v1's model file)."""
    import mlflow

    from trainyard.track.registry import log_onnx_model, register_and_promote
    from trainyard.track.version_card import describe_version
    from trainyard.track.versions import CARD_ARTIFACT_DIR

    uri, experiment = mlflow_db
    tmp = tmp_path_factory.mktemp("cards")
    client = mlflow.MlflowClient(uri)
    runs, models = [], []
    for version in (1, 2):
        path, _ = write_tiny_onnx(tmp / f"m{version}", fashion_card(), seed=version)
        with mlflow.start_run(experiment_id=experiment) as run:
            model_uri = log_onnx_model(path, np.zeros((1, 1, 28, 28), np.float32))
            if version == 1:
                reports = tmp / "reports"
                reports.mkdir()
                (reports / "model_card.md").write_text(CARD_MD)
                (reports / "model_card.json").write_text(json.dumps(CARD_JSON))
                for name in ("model_card.md", "model_card.json"):
                    mlflow.log_artifact(str(reports / name), CARD_ARTIFACT_DIR)
        accuracy = 0.9 - version / 10
        register_and_promote(
            client, "cards", model_uri, run.info.run_id, accuracy, "d", sha256_file(path), 0.0
        )
        runs.append(run.info.run_id)
        models.append(path)
    describe_version(client, "cards", 1, CARD_MD)
    return uri, runs, models[0]


@pytest.fixture
def tracking(registered, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered[0])
    return registered


def card(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["card", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_champions_card_by_alias_number_and_run(tracking, capsys):
    _, runs, _ = tracking
    for ref in ("models:/cards@champion", "models:/cards/1", f"runs:/{runs[0]}"):
        assert card(capsys, ref) == (0, CARD_MD, ""), ref
    code, out, _ = card(capsys, "models:/cards@champion", "--json")
    assert code == 0 and json.loads(out) == CARD_JSON


def test_the_versions_description_is_its_card(tracking):
    import mlflow

    version = mlflow.MlflowClient(tracking[0]).get_model_version("cards", "1")
    assert version.description == CARD_MD


def test_a_version_evaluated_before_cards_says_it_has_none(tracking, capsys):
    code, out, err = card(capsys, "models:/cards/2")
    assert code == 1 and out == ""
    assert "models:/cards/2 (v2) has no model card" in err and "dvc repro evaluate" in err
    code, _, err = card(capsys, "models:/cards@nope")
    assert code == 1 and "not found in the registry" in err


def test_a_model_file_s_card_is_the_one_beside_it(tmp_path, capsys):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"onnx")
    code, out, err = card(capsys, str(model))
    assert code == 1 and out == "" and "no card for this model" in err
    assert "model.card.md does not exist" in err
    card_beside(model, "md").write_text(CARD_MD)
    card_beside(model, "json").write_text(json.dumps(CARD_JSON))
    assert card(capsys, str(model)) == (0, CARD_MD, "")
    assert json.loads(card(capsys, str(model), "--json")[1]) == CARD_JSON
    assert card(capsys, str(card_beside(model, "md"))) == (0, CARD_MD, "")  # the file itself


def test_a_long_card_is_cut_at_a_section_to_fit_the_registry():
    sections = [f"## Section {i}\n\n" + "x" * 900 + "\n" for i in range(8)]
    markdown = "# Model card: big\n\n" + "\n".join(sections)
    cut = description_of(markdown, "trainyard card models:/big/4")
    assert len(markdown) > MAX_DESCRIPTION >= len(cut)
    assert cut.startswith("# Model card: big\n\n## Section 0")
    assert "## Section 4" in cut and "## Section 5" not in cut  # whole sections only
    assert cut.rstrip().endswith("`trainyard card models:/big/4` prints all of it._")
    assert description_of("# short\n", "x") == "# short\n"
    assert len(description_of("y" * 9000, "z")) <= MAX_DESCRIPTION  # no heading to cut at
