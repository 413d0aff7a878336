"""``trainyard report``: reports/report.md of a workspace against a baseline revision.

Real git and DVC, the real console script: a clone of this repository (its committed
reports/*.json and *.png are a real pipeline run), where the workspace then looks as a new
run would have left it (params, metrics, registry, train record, pictures, dvc.lock).
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from PIL import Image

from conftest import REPO, VENV_BIN, git_env, run_ok, stage_env

PICTURES = ("confusion_matrix.png", "confusion_matrix_normalized.png", "learning_curves.png")


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=repo, env=git_env(), capture_output=True, check=True
    ).stdout
    return out.decode().strip()


def report(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "trainyard"), "report", *args],
        cwd=repo,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def committed(repo: Path, path: str) -> bytes:
    return subprocess.run(
        ["git", "show", f"HEAD:{path}"], cwd=repo, capture_output=True, check=True
    ).stdout


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, format="PNG")
    return buf.getvalue()


def relock(repo: Path) -> None:
    """dvc.lock's params as a run with the workspace's params.yaml records them."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    lock_path = repo / "dvc.lock"
    lock = yaml.safe_load(lock_path.read_text())
    for stage in lock["stages"].values():
        for key in stage.get("params", {}).get("params.yaml", {}):
            value = params
            for part in key.split("."):
                value = value[part]
            stage["params"]["params.yaml"][key] = value
    lock_path.write_text(yaml.safe_dump(lock, sort_keys=False))


def new_run(repo: Path) -> dict:
    """The workspace as a run with train.weight_decay 0.01 leaves it; its new values."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["weight_decay"] = 0.01
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    relock(repo)
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    metrics["test"]["accuracy"] = 0.9312
    metrics["train"]["best_val_acc"] = 0.9301
    (repo / "reports/metrics.json").write_text(json.dumps(metrics, indent=2))
    reg = json.loads((repo / "reports/registry.json").read_text())
    champion = reg["version"]
    reg.update(
        alias="champion",
        already_registered=False,  # a new run registers a new version
        version=champion + 1,
        previous_champion=champion,
        reason=f"test accuracy 0.9312 beats champion v{champion} (0.9208) by more than the "
        "margin 0",
    )
    (repo / "reports/registry.json").write_text(json.dumps(reg, indent=2))
    train = json.loads((repo / "models/train.json").read_text())
    train.update(run_id="feedc0de" * 4, epochs_run=9)
    (repo / "models/train.json").write_text(json.dumps(train, indent=2))
    for i, name in enumerate(PICTURES):
        (repo / "reports" / name).write_bytes(png((40 * i, 200, 90)))
    return {"registry": reg}


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(repo)], check=True, env=git_env())
    git(repo, "checkout", "-q", "-B", "main")
    return repo


def test_report_against_the_baseline(clone: Path) -> None:
    base_params = yaml.safe_load(committed(clone, "params.yaml"))
    base_metrics = json.loads(committed(clone, "reports/metrics.json"))
    run = new_run(clone)
    # A DVC experiment holding this workspace, under DVC's ref layout (what `dvc exp run`
    # leaves): DVC itself lists it, and the report names it.
    head = git(clone, "rev-parse", "HEAD")
    git(
        clone,
        "update-ref",
        f"refs/exps/{head[:2]}/{head[2:]}/tidy-exp",
        git(clone, "stash", "create"),
    )
    listed = run_ok([str(VENV_BIN / "dvc"), "exp", "list", "--name-only"], clone).stdout
    assert "tidy-exp" in listed

    proc = report(clone, "--baseline", "HEAD")
    assert proc.returncode == 0, proc.stderr
    out = clone / "reports/report.md"
    assert proc.stdout.strip() == str(out)
    text = out.read_text()

    assert f"`HEAD` `{head[:7]}`" in text
    assert f"HEAD `{head[:7]}` with uncommitted changes (DVC experiment `tidy-exp`)" in text
    assert "| `feedc0de` in `" in text and "`, 9 epochs |" in text
    assert "Warning" not in text  # dvc.lock matches params.yaml: the outputs are its run's

    old_wd = base_params["train"]["weight_decay"]
    assert f"| `train.weight_decay` | {json.dumps(old_wd)} | **0.01** |" in text
    assert "1 param changed" in text

    old_acc, new_acc = base_metrics["test"]["accuracy"], 0.9312
    delta = new_acc - old_acc
    assert delta > 0
    row = (
        f"| `test.accuracy` | {old_acc:.4f} | {new_acc:.4f} | "
        f"▲ +{delta:.4f} (+{delta / old_acc:.1%}) |"
    )
    assert row in text
    assert f"**test.accuracy: {old_acc:.4f} → {new_acc:.4f}**" in text
    old_f1 = base_metrics["test"]["macro_f1"]
    assert f"| `test.macro_f1` | {old_f1:.4f} | {old_f1:.4f} | = |" in text

    reg = run["registry"]
    assert (
        f"- workspace: **{reg['model_name']} v{reg['version']}** became **champion**: "
        f"test accuracy 0.9312 beats champion v{reg['previous_champion']}"
    ) in text

    folder = clone / "reports/report"
    for name in PICTURES:
        base_png, work_png = folder / f"baseline-{name}", folder / f"workspace-{name}"
        assert f"](report/baseline-{name})" in text and f"](report/workspace-{name})" in text
        assert base_png.read_bytes() == committed(clone, f"reports/{name}")
        assert work_png.read_bytes() == (clone / "reports" / name).read_bytes()
        assert base_png.read_bytes() != work_png.read_bytes()
        for path in (base_png, work_png):
            with Image.open(path) as im:
                im.verify()
                assert im.format == "PNG"


def test_stale_workspace_missing_picture_and_errors(clone: Path, tmp_path: Path) -> None:
    # params.yaml edited, nothing rerun: the report says its results are not those params'.
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["train"]["weight_decay"] = 0.01
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (clone / "reports/learning_curves.png").unlink()
    proc = report(clone)  # default baseline: main
    assert proc.returncode == 0, proc.stderr
    text = (clone / "reports/report.md").read_text()
    assert "workspace vs `main`" in text
    assert (
        "not from its params" in text
        and "`train.weight_decay` (0.05 in dvc.lock, 0.01 now)" in text
    )
    assert "_no reports/learning_curves.png in the workspace_" in text
    assert not (clone / "reports/report/workspace-learning_curves.png").exists()
    assert (clone / "reports/report/baseline-learning_curves.png").is_file()

    # No `main`: HEAD, said so.
    git(clone, "branch", "-q", "-m", "main", "feature")
    proc = report(clone, "--out", "pr.md")
    assert proc.returncode == 0, proc.stderr
    assert "no `main` branch here: the baseline is HEAD instead" in (clone / "pr.md").read_text()
    assert (clone / "pr/baseline-confusion_matrix.png").is_file()

    proc = report(clone, "--baseline", "no-such-rev", "--out", "bad.md")
    assert proc.returncode == 2
    assert "--baseline no-such-rev: no such revision" in proc.stderr
    assert not (clone / "bad.md").exists()

    # --out whose picture folder is not a report's: refused, the folder left alone.
    proc = report(clone, "--out", "models.md")
    assert proc.returncode == 1 and "models exists and is not" in proc.stderr
    assert (clone / "models/train.json").is_file()

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    proc = report(outside)
    assert proc.returncode == 1
    assert "not inside a git repository" in proc.stderr


def test_make_report(clone: Path) -> None:
    venv = VENV_BIN.parent
    # -o: the clone's pyproject.toml is newer than the venv's stamp; do not reinstall.
    make = ["make", "-o", f"{venv}/.installed", "report", f"VENV={venv}"]
    proc = run_ok([*make, "REPORT_ARGS=--baseline HEAD"], clone, timeout=120)
    text = (clone / "reports/report.md").read_text()
    assert "workspace vs `HEAD`" in text and "No param differs from `HEAD`." in text
    assert str(clone / "reports/report.md") in proc.stdout
