"""Your own images: a real `dvc exp run` on a class-per-folder tree made here, through train,
export, evaluate and the registry, then the service on the exported model.

The folder has three classes of drawn shapes in mixed sizes, modes and formats, OS litter
and three broken files; its path has a space in it. Everything downstream must take the
contract (classes, channels, size, resize policy) from the dataset card, never from
Fashion-MNIST. Training runs on the recipe's choices (train.recipe: auto), as a user's
first run does; only its time budget is small, for speed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests

from trainyard.model.lite import LITE_ARCH
from trainyard.model.weights import PACKAGED
from trainyard.training.recipe import KEYS as RECIPE_KEYS

from conftest import PHOTO_CLASSES, STAGES, copy_repo, dvc, make_photo_folder, set_params

pytestmark = pytest.mark.slow
SIZE = 32  # data.image_size: auto would take 64 here (4x the pixels a step)
BUDGET_MIN = 0.2  # train.time_budget_min: the recipe plans about 12 s of epochs


def ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("photos") / "My Photos"
    made = make_photo_folder(root, per_class=40, bad=True)
    return {"root": root, **made}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, photos) -> Path:
    # params.yaml as shipped: train.pretrained: auto, the default this test proves
    repo = copy_repo(tmp_path_factory.mktemp("folder-pipeline") / "trainyard", shipped_params=True)
    set_params(repo, mlflow={"system_metrics": False})
    # What the README tells a user to type, every train key left to the recipe (a short
    # time budget and a smaller image size, for speed).
    out = dvc(
        repo,
        "exp",
        "run",
        "-S",
        "data.source=folder",
        "-S",
        f"data.folder={photos['root']}",
        "-S",
        "data.on_bad_file=skip",
        "-S",
        f"train.time_budget_min={BUDGET_MIN}",
        "-S",
        f"data.image_size={SIZE}",
    )
    (repo / "first_run.log").write_text(out.stdout + out.stderr)
    return repo


def card_of(repo: Path) -> dict:
    return json.loads((repo / "data/prepared/card.json").read_text())


def recipe_lines(log: str) -> dict[str, str]:
    """The train stage's recipe lines, by key: ``"<value> (<who>: <why>)"``; each key once."""
    said: dict[str, str] = {}
    for line in log.splitlines():
        # "recipe auto: ..." or, for a fine-tune, "recipe auto (fine-tune) (...): ..."
        if head := re.match(r"\[train\] recipe auto(?: \([^)]*\))*: train\.", line):
            key, _, choice = line[head.end() :].partition(" = ")
            assert key not in said, f"train.{key} said twice:\n{log[-3000:]}"
            said[key] = choice
    return said


def train_run(repo: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    info = json.loads((repo / "models/train.json").read_text())
    return client, client.get_run(info["run_id"])


def test_every_stage_ran_and_the_card_describes_the_folder(repo, photos):
    log = (repo / "first_run.log").read_text()
    assert ran(log) == set(STAGES), log[-3000:]
    assert "[fetch] data.source is 'folder'; nothing to fetch" in log
    card = card_of(repo)
    assert card["source"] == "folder" and card["classes"] == list(PHOTO_CLASSES)
    assert (card["channels"], card["height"], card["width"]) == (3, SIZE, SIZE)
    assert card["resize"] == "crop" and len(card["mean"]) == len(card["std"]) == 3
    assert sorted(s["file"] for s in card["skipped"]) == sorted(photos["bad"])
    assert card["ignored"] == 1  # notes.txt; .DS_Store, Thumbs.db, dot-folders pass silently
    total = sum(card["counts"][s]["total"] for s in ("train", "val", "test"))
    assert total == len(photos["good"])
    images = np.load(repo / "data/prepared/train_images.npy", mmap_mode="r")
    assert images.shape == (card["counts"]["train"]["total"], 3, SIZE, SIZE)


def test_the_recipe_chose_every_train_key_and_said_why(repo, tmp_path):
    said = recipe_lines((repo / "first_run.log").read_text())
    assert tuple(said) == RECIPE_KEYS, said  # one line per choice, in the recipe's order
    for key, choice in said.items():
        assert re.fullmatch(r"\S+ \(recipe: .+\)", choice), (key, choice)
    n_train = card_of(repo)["counts"]["train"]["total"]
    # ~32 optimizer steps an epoch, but never under 16 images a step: a small folder gets 16.
    steps = -(-n_train // 16)
    why = f"{n_train} train images: {steps} optimizer steps an epoch"
    assert said["batch_size"] == f"16 (recipe: {why})"
    # Shapes of 40-160 px: the packaged ImageNet weights, fine-tuned with the front frozen.
    assert re.fullmatch(
        r"imagenet \(recipe: \d+ px images: Google's EfficientNet-Lite0 .+", said["pretrained"]
    )
    assert said["arch"] == "efficientnet_lite0 (recipe: fine-tunes its packaged ImageNet weights)"
    assert f"{BUDGET_MIN:g} min budget / " in said["max_epochs"]
    # The run records the same choices: a tag each, the plan, and the resolved params.
    client, run = train_run(repo)
    for key, choice in said.items():
        assert run.data.tags[f"recipe.{key}"] == choice, key
    plan = json.loads(
        Path(
            client.download_artifacts(run.info.run_id, "config/recipe.json", str(tmp_path))
        ).read_text()
    )
    assert (plan["recipe"], plan["finetune"], plan["frozen_stages"]) == ("auto", True, 7)
    # Which weights, their bytes and their licence: on the run, in the model, at /metadata.
    assert run.data.tags["pretrained.sha256"] == PACKAGED[LITE_ARCH].sha256
    assert "Apache-2.0" in run.data.tags["pretrained.license"]
    assert {k: c["by"] for k, c in plan["choices"].items()} == dict.fromkeys(RECIPE_KEYS, "recipe")
    assert plan["choices"]["batch_size"]["value"] == 16
    epochs = plan["choices"]["max_epochs"]["value"]
    assert said["max_epochs"].startswith(f"{epochs} (recipe: ")
    assert run.data.params["train.batch_size"] == "16"
    assert run.data.params["train.max_epochs"] == str(epochs)
    assert run.data.params["train.time_budget_min"] == str(BUDGET_MIN)


def test_the_exported_model_carries_the_folder_contract_and_learned(repo):
    meta = {p.key: p.value for p in onnx.load(str(repo / "models/model.onnx")).metadata_props}
    contract = json.loads(meta["dataset_card"])
    card = card_of(repo)
    for key in ("classes", "channels", "height", "width", "mean", "std", "resize", "source"):
        assert contract[key] == card[key], key
    assert json.loads(meta["classes"]) == list(PHOTO_CLASSES)
    assert json.loads(meta["input_shape"]) == [-1, 3, SIZE, SIZE]
    assert json.loads(meta["pretrained"])["sha256"] == PACKAGED[LITE_ARCH].sha256
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    # Shapes are easy: far above chance (1/3) after the recipe's short run.
    assert metrics["test"]["accuracy"] >= 0.7, metrics
    assert metrics["export"]["argmax_agreement"] == 1.0
    with open(repo / "reports/predictions.csv") as fh:
        labels = {line.split(",")[0] for line in list(fh)[1:]}
    assert labels == set(PHOTO_CLASSES)


def test_registry_and_mlflow_record_the_folder_dataset(repo):
    from mlflow.tracking import MlflowClient

    registry = json.loads((repo / "reports/registry.json").read_text())
    # One registered model per dataset: a shapes model never competes with Fashion-MNIST's.
    assert registry["model_name"] == "My-Photos-classifier"
    assert (registry["version"], registry["alias"]) == (1, "champion")
    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    version = client.get_model_version(registry["model_name"], "1")
    assert json.loads(version.tags["dataset.classes"]) == list(PHOTO_CLASSES)
    assert version.tags["input_shape"] == f"3x{SIZE}x{SIZE}"
    info = json.loads((repo / "models/train.json").read_text())
    assert version.tags["data_version"] == info["data_version"]
    run = client.get_run(info["run_id"])
    assert run.data.tags["data.source"] == "folder"
    assert run.data.tags["data.skipped_files"] == "3"
    # `dvc exp run -S` set params.yaml: the model card names the experiment that holds them
    exp = run.data.tags["dvc.exp_name"]
    model_card = json.loads((repo / "reports/model_card.json").read_text())
    assert (model_card["data"]["dvc_experiment"], run.data.tags["git.dirty"]) == (exp, "true")
    assert f"run as DVC experiment `{exp}`" in (repo / "reports/model_card.md").read_text()
    # which images trained the shipped model, tagged as the run completed (train.refit)
    assert run.data.tags["refit"].startswith(f"{info['refit']['trained_on']}, ")
    assert run.data.metrics["data/skipped_files"] == 3
    assert [a.path for a in client.list_artifacts(run.info.run_id, "data")] == ["data/card.json"]
    inputs = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert inputs == {"folder-train", "folder-val"}


def test_the_service_serves_the_folder_model_by_its_card(repo, photos, tmp_path):
    from test_serving import Server, server_env, write_params

    from trainyard.core.card import load_card
    from trainyard.runtime.inputs import decode_image, model_input, softmax
    from trainyard.runtime.sessions import load_onnx

    card = load_card(repo / "data/prepared")
    params = write_params(tmp_path / "params.yaml")
    server = Server(server_env(params, repo / "models/model.onnx"), tmp_path / "serve.log")
    try:
        server.wait_ready()
        meta = requests.get(f"{server.url}/metadata", timeout=10).json()
        assert meta["classes"] == list(PHOTO_CLASSES)
        assert meta["input"]["shape"] == [-1, 3, SIZE, SIZE]
        assert meta["input"]["resize"] == "crop"
        assert meta["model"]["pretrained"]["source"].startswith("pypi:efficientnet-lite0")
        model = load_onnx(repo / "models/model.onnx", device="cpu")
        for rel in photos["good"][:: len(photos["good"]) // 6]:
            data = (photos["root"] / rel).read_bytes()
            got = requests.post(
                f"{server.url}/classify", files={"image": (Path(rel).name, data)}, timeout=30
            )
            assert got.status_code == 200, got.text
            # Offline: the same bytes through the same image->pixels function and the card.
            x = model_input(decode_image(data, card)[None], card)
            expected = softmax(model.run(x))[0]
            assert np.allclose(got.json()["probabilities"], expected, atol=1e-5), rel
            assert got.json()["label"] == PHOTO_CLASSES[int(expected.argmax())]
    finally:
        server.stop()


def test_with_on_bad_file_error_the_run_names_each_broken_file(repo, photos):
    lock = (repo / "dvc.lock").read_text()
    set_params(repo, data={"on_bad_file": "error"})
    try:
        out = dvc(repo, "repro", check=False)
    finally:
        set_params(repo, data={"on_bad_file": "skip"})
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "3 bad file(s)" in text
    for rel in photos["bad"]:
        assert rel in text, rel
    assert (repo / "dvc.lock").read_text() == lock
    # DVC removes a stage's outputs before running it; the last good ones are in its cache.
    dvc(repo, "checkout")
    assert "up to date" in dvc(repo, "status", "evaluate").stdout


def test_adding_one_image_reruns_prepare_and_changes_the_data_version(repo, photos):
    before = json.loads((repo / "models/train.json").read_text())
    status = dvc(repo, "status", "evaluate").stdout
    assert "up to date" in status, status
    first = photos["root"] / photos["good"][0]
    shutil.copyfile(first, first.with_name("added" + first.suffix))
    try:
        status = dvc(repo, "status", "prepare").stdout
        assert "modified:" in status and str(photos["root"]) in status, status
        out = dvc(repo, "repro")
    finally:
        first.with_name("added" + first.suffix).unlink()
    assert {"prepare", "train", "export", "evaluate"} <= ran(out.stdout)
    after = json.loads((repo / "models/train.json").read_text())
    assert after["data_version"] != before["data_version"]
    registry = json.loads((repo / "reports/registry.json").read_text())
    assert registry["version"] == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    v2 = client.get_model_version(registry["model_name"], "2")
    assert v2.tags["data_version"] == after["data_version"]
    assert client.get_run(after["run_id"]).data.tags["data.dvc_md5"] == after["data_version"]


def test_a_train_key_set_with_S_wins_over_the_recipe(repo):
    # Last: it leaves export and evaluate out of date. A tiny budget: a few epochs.
    out = dvc(
        repo, "exp", "run", "-S", "train.batch_size=8", "-S", "train.time_budget_min=0.05", "train"
    )
    assert ran(out.stdout) == {"train"}, out.stdout[-3000:]
    said = recipe_lines(out.stdout + out.stderr)
    assert tuple(said) == RECIPE_KEYS, said
    assert said["batch_size"] == "8 (params: set in params)"
    for key in set(RECIPE_KEYS) - {"batch_size"}:  # the rest stay the recipe's
        assert "(recipe: " in said[key], (key, said[key])
    assert "0.05 min budget / " in said["max_epochs"]  # epochs planned for batch 8's steps
    _, run = train_run(repo)
    assert run.data.tags["recipe.batch_size"] == "8 (params: set in params)"
    assert run.data.params["train.batch_size"] == "8"
