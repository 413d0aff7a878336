"""The image-folder source: scanning, splitting, bad files, and prepare end to end."""

from __future__ import annotations

import concurrent.futures
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from image_bytes import encode, png_claiming
from PIL import Image

from trainyard.core.card import SPLITS, Card, load_card
from trainyard.core.config import DataParams
from trainyard.core.errors import DataError
from trainyard.data import image_files
from trainyard.data.sources import prepare_source as prepare
from trainyard.data.splits import assign_splits, find_duplicates
from trainyard.data.walk import scan_folder
from trainyard.runtime.inputs import decode_image

from conftest import make_photo_folder

TREE_CLASSES = ("circle", "Square", "10 triangle")  # sorted: "10 triangle", "Square", "circle"


# ----------------------------------------------------------------------------- helpers


def params(root: Path, **kw) -> DataParams:
    base = {
        "source": "folder",
        "folder": str(root),
        "image_size": 32,
        "val_fraction": 0.2,
        "test_fraction": 0.2,
        "workers": 1,
    }
    return DataParams(**(base | kw))


def run(root: Path, out: Path, seed: int = 0, **kw) -> Card:
    return prepare(out.parent / "raw", out, params(root, **kw), seed)


def arrays(out: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {s: (np.load(out / f"{s}_images.npy"), np.load(out / f"{s}_labels.npy")) for s in SPLITS}


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), "a temp folder was left behind"


def solid(path: Path, colour, size: int = 16, mode: str = "RGB", fmt: str = "PNG") -> Path:
    """A one-colour image: at the prepared size it comes back as exactly this colour."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (size, size), colour).save(path, fmt)
    return path


def colour_of(i: int) -> tuple[int, int, int]:
    return (i % 256, (i // 256) * 40 + 7, (i * 37) % 256)


def row_colours(images: np.ndarray) -> list[tuple[int, ...]]:
    """The colour of each one-colour row (asserting that it is one colour)."""
    out = []
    for row in images:
        first = row[:, 0, 0]
        assert (row == first[:, None, None]).all()
        out.append(tuple(int(v) for v in first))
    return out


def truncated_jpeg() -> bytes:
    rgb = np.random.default_rng(5).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    data = encode(Image.fromarray(rgb, "RGB"), "JPEG")
    return data[: len(data) // 2]


def split_tree(root: Path, counts: dict[str, dict[str, int]]) -> dict[str, dict[str, set]]:
    """root/<split>/<class>/NN.png, each a unique solid colour; returns the colours."""
    colours: dict[str, dict[str, set]] = {}
    i = 0
    for split, per_class in counts.items():
        for name, n in per_class.items():
            for k in range(n):
                solid(root / split / name / f"{k:02d}.png", colour_of(i))
                colours.setdefault(split, {}).setdefault(name, set()).add(colour_of(i))
                i += 1
    return colours


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    """A good tree: 3 classes x 9 images of every format and mode, plus OS litter."""
    root = tmp_path_factory.mktemp("tree") / "photos"
    files = make_photo_folder(root, per_class=9, classes=TREE_CLASSES, litter=True)
    (root / "__MACOSX" / "circle").mkdir(parents=True)
    (root / "__MACOSX" / "circle" / "._img_001.jpg").write_bytes(b"\0\5\26\7")
    (root / "circle" / "desktop.ini").write_text("[.ShellClassInfo]\n")
    return root, files


@pytest.fixture(scope="module")
def prepared(photos, tmp_path_factory) -> tuple[Path, Card]:
    out = tmp_path_factory.mktemp("prep") / "prepared"
    return out, run(photos[0], out, seed=0)


# ----------------------------------------------------------------------------- a good tree


def test_good_tree_end_to_end(photos, prepared):
    root, files = photos
    out, card = prepared
    n_good = len(files["good"])
    assert n_good == 27
    data = arrays(out)
    for split, (images, labels) in data.items():
        assert images.dtype == np.uint8 and images.ndim == 4
        assert images.shape[1:] == (3, 32, 32)
        assert labels.dtype == np.int32
        assert labels.shape == (images.shape[0],)
        assert set(labels.tolist()) == {0, 1, 2}, split  # stratified: every class everywhere
    assert sum(images.shape[0] for images, _ in data.values()) == n_good

    assert card.source == "folder"
    assert card.classes == ("10 triangle", "Square", "circle")
    tv_folder = pytest.importorskip("torchvision.datasets.folder")
    tv_classes, _ = tv_folder.find_classes(str(root))
    # torchvision also lists hidden and OS-litter folders as classes; we pass over them
    assert card.classes == tuple(c for c in tv_classes if c not in (".hidden", "__MACOSX"))

    assert card.channels == 3
    assert card.input_shape == (3, 32, 32)
    assert card.resize == "crop"  # DataParams' default
    per_class_total = dict.fromkeys(card.classes, 0)
    for split, (images, labels) in data.items():
        counts = card.counts[split]
        assert counts["total"] == images.shape[0]
        bincount = np.bincount(labels, minlength=3)
        assert counts["per_class"] == {c: int(bincount[i]) for i, c in enumerate(card.classes)}
        for c, k in counts["per_class"].items():
            per_class_total[c] += k
    assert per_class_total == dict.fromkeys(card.classes, 9)
    assert {s: card.counts[s]["total"] for s in SPLITS} == {"train": 15, "val": 6, "test": 6}

    train = data["train"][0].astype(np.float64) / 255.0
    np.testing.assert_allclose(card.mean, train.mean(axis=(0, 2, 3)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(card.std, train.std(axis=(0, 2, 3)), atol=1e-6, rtol=0)

    assert card.ignored == 1  # notes.txt; litter and hidden files are not even counted
    assert card.skipped == ()
    assert card.duplicates["across_splits"] == 0 and card.duplicates["removed"] is False
    assert card.extra["layout"] == "flat" and card.extra["seed"] == 0
    assert load_card(out) == card
    on_disk = json.loads((out / "card.json").read_text(encoding="utf-8"))
    assert "/" not in json.dumps(on_disk["extra"])  # no absolute path in the data version
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["card.json"] + [f"{s}_{k}.npy" for s in SPLITS for k in ("images", "labels")]
    )


def test_same_seed_same_data_other_seed_other_split(photos, prepared, tmp_path):
    root, _ = photos
    out0, card0 = prepared
    again = run(root, tmp_path / "again", seed=0)
    assert again.data_sha256 == card0.data_sha256
    assert again == card0
    other = run(root, tmp_path / "other", seed=1)
    assert other.source_sha256 == card0.source_sha256  # same files...
    assert other.data_sha256 != card0.data_sha256  # ...split differently
    assert other.counts == card0.counts  # the same stratified sizes
    val0 = {r.tobytes() for r in arrays(out0)["val"][0]}
    val1 = {r.tobytes() for r in arrays(tmp_path / "other")["val"][0]}
    assert val0 != val1


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch"])
def test_train_serve_identity(photos, tmp_path, resize):
    """Each prepared row is exactly what the service computes from the same file bytes."""
    root, files = photos
    out = tmp_path / "prepared"
    card = run(root, out, image_size=(24, 40), resize=resize)
    assert load_card(out) == card and (card.height, card.width) == (24, 40)
    rows: dict[bytes, list[tuple[str, int]]] = {}
    for split, (images, labels) in arrays(out).items():
        for image, label in zip(images, labels, strict=True):
            rows.setdefault(image.tobytes(), []).append((split, int(label)))
    seen_kinds = set()
    for rel in files["good"]:
        data = (root / rel).read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            seen_kinds.add((im.format, im.mode))
        pixels = decode_image(data, card)
        assert pixels.shape == (3, 24, 40)
        found = rows.get(pixels.tobytes())
        assert found, f"{rel}: no prepared row equals decode_image of its bytes"
        assert len(found) == 1
        assert found[0][1] == card.classes.index(rel.split("/")[0])
    assert sum(len(v) for v in rows.values()) == len(files["good"])
    for kind in [("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGBA"), ("PNG", "LA"), ("GIF", "P")]:
        assert kind in seen_kinds


def test_drawings_with_transparency_are_composited_on_white(tmp_path):
    """A folder of transparent drawings with dark strokes (clip art): the background is
    white, as every viewer shows them (on black, a black outline vanishes); the card's fill
    says so, and the service composites an upload on it the same way. Transparent icons of
    bright colour without dark strokes (emoji) and photos stay on black."""
    root = tmp_path / "drawings"
    for c, name in enumerate(("ring", "bar")):
        (root / name).mkdir(parents=True)
        for i in range(6):
            a = np.zeros((20, 20, 4), np.uint8)  # transparent...
            if c:
                a[8:12, 2:18] = (0, 0, 0, 255)  # ...around a black outline
            else:
                a[2:18, 2:18], a[5:15, 5:15] = (0, 0, 0, 255), 0
            Image.fromarray(a, "RGBA").save(root / name / f"{i}.png")
    card = run(root, tmp_path / "out", image_size=20)
    assert card.fill == 255
    x = arrays(tmp_path / "out")["train"][0]
    assert x[:, :, 0, 0].min() == 255  # the corner: transparent, now white
    assert x.min() == 0  # the black outline stays visible
    data = (root / "bar" / "0.png").read_bytes()
    assert decode_image(data, card)[:, 0, 0].tolist() == [255, 255, 255]
    mixed = tmp_path / "mixed"  # a few transparent files in a photo folder: black, as before
    make_photo_folder(mixed, per_class=9)
    assert run(mixed, tmp_path / "out2", image_size=16).fill == 0
    icons = tmp_path / "icons"  # transparent, bright colour and no dark strokes (emoji): black
    for c, colour in enumerate(((250, 200, 40, 255), (90, 200, 250, 255))):
        (icons / f"c{c}").mkdir(parents=True)
        for i in range(6):
            a = np.zeros((20, 20, 4), np.uint8)
            a[3 + i % 3 : 17, 3:17] = colour
            Image.fromarray(a, "RGBA").save(icons / f"c{c}" / f"{i}.png")
    assert run(icons, tmp_path / "out3", image_size=20).fill == 0


# ----------------------------------------------------------------------------- channels


def gray_tree(root: Path) -> None:
    rng = np.random.default_rng(6)
    for name in ("dark", "light"):
        for i in range(5):
            g = rng.integers(0, 256, (20, 28), dtype=np.uint8)
            im = Image.fromarray(g, "L")
            fmt = ("PNG", "JPEG", "GIF", "PNG", "TIFF")[i]
            ext = {"JPEG": "jpg", "TIFF": "tif"}.get(fmt, fmt.lower())
            if i == 3:  # 16-bit
                im = Image.fromarray(g.astype(np.uint16) * 257)
            (root / name).mkdir(parents=True, exist_ok=True)
            im.save(root / name / f"{i}.{ext}", fmt)


def test_channels_auto_is_1_for_an_all_grayscale_tree(tmp_path):
    gray_tree(tmp_path / "gray")
    card = run(tmp_path / "gray", tmp_path / "out", image_size=16)
    assert card.channels == 1
    assert len(card.mean) == 1
    assert arrays(tmp_path / "out")["train"][0].shape[1:] == (1, 16, 16)


def test_channels_auto_is_3_with_one_colour_image(tmp_path):
    gray_tree(tmp_path / "mixed")
    solid(tmp_path / "mixed" / "dark" / "colour.png", (200, 10, 10), 20)
    card = run(tmp_path / "mixed", tmp_path / "out", image_size=16)
    assert card.channels == 3
    assert arrays(tmp_path / "out")["train"][0].shape[1:] == (3, 16, 16)


def test_channels_3_forces_3_on_a_grayscale_tree(tmp_path):
    gray_tree(tmp_path / "gray")
    card = run(tmp_path / "gray", tmp_path / "out", image_size=16, channels=3)
    assert card.channels == 3 and card.extra["channels_param"] == 3
    images = arrays(tmp_path / "out")["train"][0]
    assert images.shape[1:] == (3, 16, 16)
    assert (images[:, 0] == images[:, 1]).all() and (images[:, 1] == images[:, 2]).all()


def test_channels_1_forces_1_on_a_colour_tree(photos, tmp_path):
    card = run(photos[0], tmp_path / "out", channels=1)
    assert card.channels == 1
    assert arrays(tmp_path / "out")["val"][0].shape[1:] == (1, 32, 32)


# ----------------------------------------------------------------------------- scanning


def test_extensions_in_any_case_are_read(tmp_path):
    root = tmp_path / "cases"
    kinds = [
        ("a.JPG", "JPEG"),
        ("b.Png", "PNG"),
        ("c.TIFF", "TIFF"),
        ("d.Jpeg", "JPEG"),
        ("e.GIF", "GIF"),
        ("f.WebP", "WEBP"),
        ("g.BMP", "BMP"),
        ("h.tif", "TIFF"),
    ]
    for c, name in enumerate(("x", "y")):
        for i, (filename, fmt) in enumerate(kinds):
            solid(root / name / filename, colour_of(10 * c + i), 16, fmt=fmt)
        (root / name / "readme.TXT").write_text("not an image\n")
    scan = scan_folder(root)
    assert sorted(Path(e.rel).name for e in scan.entries) == sorted([k for k, _ in kinds] * 2)
    card = run(root, tmp_path / "out", image_size=16)
    assert sum(card.counts[s]["total"] for s in SPLITS) == 16
    assert card.ignored == 2 and card.skipped == ()


def test_scan_walks_subfolders_and_passes_over_litter(tmp_path):
    root = tmp_path / "photos"
    solid(root / "a" / "1.png", (1, 1, 1))
    solid(root / "a" / "deeper" / "still" / "2.jpg", (2, 2, 2), fmt="JPEG")
    solid(root / "b" / "3.png", (3, 3, 3))
    solid(root / "b" / ".cache" / "4.png", (4, 4, 4))  # hidden folder
    solid(root / "b" / "._3.png", (5, 5, 5))  # AppleDouble (and a real image even so)
    solid(root / "__MACOSX" / "a" / "5.png", (6, 6, 6))
    (root / "b" / "Thumbs.db").write_bytes(b"\xd0\xcf")
    (root / "b" / "labels.json").write_text("{}")
    (root / ".DS_Store").write_bytes(b"Bud1")
    scan = scan_folder(root)
    assert scan.classes == ("a", "b")
    assert scan.layout == "flat"
    assert [(e.rel, e.label, e.split) for e in scan.entries] == [
        ("a/1.png", 0, None),
        ("a/deeper/still/2.jpg", 0, None),
        ("b/3.png", 1, None),
    ]
    assert scan.bad == [] and scan.ignored == 1


# ----------------------------------------------------------------------------- layouts


def test_split_layout_keeps_the_users_splits(tmp_path):
    counts = {
        "train": {"ant": 4, "bee": 5},
        "val": {"ant": 2, "bee": 1},
        "test": {"ant": 1, "bee": 3},
    }
    colours = split_tree(tmp_path / "photos", counts)
    card = run(tmp_path / "photos", tmp_path / "out", image_size=16)
    assert card.extra["layout"] == "splits"
    for split in SPLITS:
        assert card.counts[split]["per_class"] == counts[split]
    for split, (images, labels) in arrays(tmp_path / "out").items():
        got = row_colours(images)
        for name in ("ant", "bee"):
            mine = {
                c for c, lab in zip(got, labels, strict=True) if lab == ("ant", "bee").index(name)
            }
            assert mine == colours[split][name], (split, name)


def test_train_only_layout_carves_val_and_test_per_class(tmp_path):
    colours = split_tree(tmp_path / "photos", {"train": {"ant": 10, "bee": 15}})
    card = run(tmp_path / "photos", tmp_path / "out", image_size=16)
    assert card.counts["val"]["per_class"] == {"ant": 2, "bee": 3}
    assert card.counts["test"]["per_class"] == {"ant": 2, "bee": 3}
    assert card.counts["train"]["per_class"] == {"ant": 6, "bee": 9}
    got = [c for images, _ in arrays(tmp_path / "out").values() for c in row_colours(images)]
    assert sorted(got) == sorted(colours["train"]["ant"] | colours["train"]["bee"])


def test_train_and_val_layout_carves_only_test(tmp_path):
    counts = {"train": {"ant": 10, "bee": 10}, "val": {"ant": 1, "bee": 2}}
    colours = split_tree(tmp_path / "photos", counts)
    card = run(tmp_path / "photos", tmp_path / "out", image_size=16)
    assert card.counts["val"]["per_class"] == {"ant": 1, "bee": 2}
    assert card.counts["test"]["per_class"] == {"ant": 2, "bee": 2}
    assert card.counts["train"]["per_class"] == {"ant": 8, "bee": 8}
    val = set(row_colours(arrays(tmp_path / "out")["val"][0]))
    assert val == colours["val"]["ant"] | colours["val"]["bee"]


def _mixed(root: Path) -> None:
    split_tree(root, {"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}})
    solid(root / "cats" / "1.png", (1, 2, 3))


def _class_missing_from_val(root: Path) -> None:
    split_tree(root, {"train": {"a": 3, "b": 3}, "val": {"a": 1}})


def _no_train(root: Path) -> None:
    split_tree(root, {"val": {"a": 2, "b": 2}, "test": {"a": 2, "b": 2}})


MIXED_LAYOUTS = [
    (_mixed, r"mixes split folders \(train, val\) with other folders \(cats\)"),
    (_class_missing_from_val, r"photos/val/ lacks the class folders 'b'"),
    (_no_train, r"has test, val/ but no train/ folder"),
]


# ----------------------------------------------------------------------------- unusable trees


def _missing(root: Path) -> None:
    pass


def _a_file(root: Path) -> None:
    root.write_bytes(b"PK\3\4 a zip, say")


def _empty(root: Path) -> None:
    root.mkdir()
    (root / "notes.txt").write_text("nothing here yet\n")
    (root / ".git").mkdir()  # hidden folders are not classes


def _one_class(root: Path) -> None:
    for i in range(5):
        solid(root / "only" / f"{i}.png", colour_of(i))


def _class_without_images(root: Path) -> None:
    for i in range(5):
        solid(root / "full" / f"{i}.png", colour_of(i))
    (root / "hollow").mkdir()
    (root / "hollow" / "notes.txt").write_text("to do\n")


def _class_too_small(root: Path) -> None:
    for i in range(10):
        solid(root / "big" / f"{i}.png", colour_of(i))
    for i in range(2):
        solid(root / "tiny" / f"{i}.png", colour_of(20 + i))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        *MIXED_LAYOUTS,
        (_missing, r"photos does not exist; set data\.folder"),
        (_a_file, r"photos is a file, not a folder"),
        (_empty, r"photos has no class subfolders; put each class's images in its own folder"),
        (_one_class, r"has only one class \('only'\); a classifier needs at least 2"),
        (_class_without_images, r"class folder .*photos/hollow has no images .*add images"),
        (
            _class_too_small,
            r"class 'tiny' has 2 image\(s\), too few for the stratified split .*need at "
            r"least 3.*add images to it",
        ),
    ],
)
def test_mixed_layouts_and_unusable_trees_are_data_errors_writing_nothing(tmp_path, make, message):
    make(tmp_path / "photos")
    with pytest.raises(DataError, match=message):
        run(tmp_path / "photos", tmp_path / "out", image_size=16)
    assert_nothing_written(tmp_path / "out")


def test_an_empty_split_is_a_data_error_and_writes_nothing(tmp_path):
    _class_too_small(tmp_path / "photos")
    solid(tmp_path / "photos" / "tiny" / "2.png", (1, 1, 1))
    with pytest.raises(DataError, match=r"the val split would be empty.*val_fraction"):
        run(tmp_path / "photos", tmp_path / "out", image_size=16, val_fraction=0)
    assert_nothing_written(tmp_path / "out")


# ----------------------------------------------------------------------------- bad files


def bad_tree(root: Path) -> tuple[list[str], dict[str, str]]:
    """A good tree (3 classes x 6) plus one of every kind of bad file; returns the good
    files and {bad file: a word its reason must hold}."""
    files = make_photo_folder(root, per_class=6, litter=True, bad=True)
    circle, square, triangle = (root / c for c in ("circle", "square", "triangle"))
    (square / "half.jpg").write_bytes(truncated_jpeg())
    # 1.6 GP, over data.max_image_pixels (1 GP): refused from the header
    (square / "bomb.png").write_bytes(png_claiming(40000, 40000))
    (triangle / "x.png").symlink_to(root / "gone" / "x.png")
    (triangle / "Gone.JPG").symlink_to("nowhere.jpg")  # relative, upper-case extension
    (triangle / "self.jpg").symlink_to("self.jpg")  # a link to itself
    (circle / "loop").symlink_to(circle)  # a folder link to the folder holding it
    (square / "up").symlink_to("..")  # ... and to the dataset root (above its class)
    reasons = {
        "circle/zero.png": "empty",
        "circle/text.jpg": "not an image",
        "circle/truncated.png": "truncated",
        "square/half.jpg": "truncated",
        "square/bomb.png": "too large (40000x40000 pixels); the limit is 1,000,000,000 "
        "pixels (data.max_image_pixels)",
        "triangle/x.png": "broken symlink",
        "triangle/Gone.JPG": "broken symlink",
        "triangle/self.jpg": "symlink loop",
        "circle/loop": "symlink loop",
        "square/up": "symlink loop",
    }
    assert sorted(files["bad"]) == sorted(
        ["circle/zero.png", "circle/text.jpg", "circle/truncated.png"]
    )
    return files["good"], reasons


def test_bad_files_are_one_error_listing_every_one(tmp_path):
    _, reasons = bad_tree(tmp_path / "photos")
    with pytest.raises(DataError) as info:
        run(tmp_path / "photos", tmp_path / "out")
    message = str(info.value)
    assert f"{len(reasons)} bad file(s) in {tmp_path / 'photos'}" in message
    listed = {line.strip().split(": ")[0] for line in message.splitlines()[1:-1]}
    assert listed == set(reasons)
    for rel, word in reasons.items():
        line = next(x for x in message.splitlines() if x.strip().startswith(f"{rel}: "))
        assert word in line, line
    assert "on_bad_file: skip" in message
    assert_nothing_written(tmp_path / "out")


def test_bad_files_are_skipped_and_recorded_with_skip(tmp_path):
    good, reasons = bad_tree(tmp_path / "photos")
    card = run(tmp_path / "photos", tmp_path / "out", on_bad_file="skip")
    skipped = {s["file"]: s["reason"] for s in card.skipped}
    assert set(skipped) == set(reasons)
    for rel, word in reasons.items():
        assert word in skipped[rel], (rel, skipped[rel])
    assert card.skipped == load_card(tmp_path / "out").skipped
    data = arrays(tmp_path / "out")
    assert sum(images.shape[0] for images, _ in data.values()) == len(good) == 18
    for split, (images, labels) in data.items():
        assert images.shape[0] == labels.shape[0] == card.counts[split]["total"]
    per_class = {c: sum(card.counts[s]["per_class"][c] for s in SPLITS) for c in card.classes}
    assert per_class == {"circle": 6, "square": 6, "triangle": 6}
    # the links back up the tree did not read other classes' images a second time
    assert card.duplicates["across_splits"] == 0
    # no all-zero row left by a file that failed to decode
    for images, _ in data.values():
        assert images.reshape(images.shape[0], -1).any(axis=1).all()


def test_bomb_limit_follows_max_image_pixels(tmp_path):
    root = tmp_path / "photos"
    for c in ("a", "b"):
        for i in range(5):
            solid(root / c / f"{i}.png", colour_of(i), 16)
    solid(root / "a" / "big.png", (1, 2, 3), 64)  # 4096 pixels
    with pytest.raises(
        DataError, match=r"a/big\.png: image too large \(64x64 pixels\).*\(data\.max_image_pixels\)"
    ):
        prepare(tmp_path / "raw", tmp_path / "out", params(root, image_size=16), 0, 4000)
    assert_nothing_written(tmp_path / "out")
    card = prepare(tmp_path / "raw", tmp_path / "out", params(root, image_size=16), 0, 4096)
    assert card.skipped == ()


# ----------------------------------------------------------------------------- duplicates


def dup_tree(root: Path) -> None:
    split_tree(
        root,
        {
            "train": {"ant": 4, "bee": 4},
            "val": {"ant": 2, "bee": 2},
            "test": {"ant": 2, "bee": 2},
        },
    )
    shutil.copy(root / "train/ant/00.png", root / "val/ant/copy_of_train.png")
    shutil.copy(root / "train/bee/01.png", root / "test/ant/train_copy_other_class.png")
    shutil.copy(root / "val/bee/00.png", root / "test/bee/copy_of_val.png")
    shutil.copy(root / "train/ant/02.png", root / "train/bee/same_split.png")  # not leakage


@pytest.mark.parametrize("dedupe", [False, True])
def test_exact_duplicates_across_splits(tmp_path, dedupe):
    dup_tree(tmp_path / "photos")
    card = run(tmp_path / "photos", tmp_path / "out", image_size=16, dedupe=dedupe)
    assert card.duplicates == {"across_splits": 3, "val": 1, "test": 2, "removed": dedupe}
    dropped = 1 if dedupe else 0
    assert card.counts["train"]["total"] == 9
    assert card.counts["val"]["total"] == 5 - dropped
    assert card.counts["test"]["total"] == 6 - 2 * dropped
    data = arrays(tmp_path / "out")
    train = set(row_colours(data["train"][0]))
    val = set(row_colours(data["val"][0]))
    test = set(row_colours(data["test"][0]))
    assert bool(train & val) is not dedupe
    assert bool((train | val) & test) is not dedupe


# ----------------------------------------------------------------------------- many classes


def test_more_than_256_classes(tmp_path):
    root = tmp_path / "photos"
    for c in range(300):
        for k in range(3):
            solid(root / f"c{c:03d}" / f"{k}.png", colour_of(3 * c + k), 8)
    card = run(root, tmp_path / "out", image_size=8, val_fraction=0.34, test_fraction=0.34)
    assert card.num_classes == 300
    for split, (images, labels) in arrays(tmp_path / "out").items():
        assert labels.dtype == np.int32
        assert labels.max() == 299
        assert sorted(labels.tolist()) == list(range(300)), split  # one of each class
        for colour, label in zip(row_colours(images), labels, strict=True):
            index = colour[0] + 256 * ((colour[1] - 7) // 40)
            assert index // 3 == label


def test_class_names_survive_into_the_card(tmp_path):
    names = ["crème brûlée", "Ångström", "two words", "日本語", "naïve-café"]
    root = tmp_path / "photos"
    for c, name in enumerate(names):
        for k in range(5):
            solid(root / name / f"{k}.png", colour_of(5 * c + k), 16)
    card = run(root, tmp_path / "out", image_size=16)
    assert card.classes == tuple(sorted(names))
    assert load_card(tmp_path / "out").classes == tuple(sorted(names))
    text = (tmp_path / "out" / "card.json").read_text(encoding="utf-8")
    for name in names:
        assert name in text
    assert card.counts["train"]["per_class"] == dict.fromkeys(sorted(names), 3)


# ----------------------------------------------------------------------------- process pool


def test_process_pool_gives_identical_data(tmp_path, monkeypatch):
    bad_tree(tmp_path / "photos")  # also exercises failed decodes and compaction in workers
    started = []

    class Recording(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, max_workers=None, *args, **kw):
            started.append(max_workers)
            super().__init__(max_workers, *args, **kw)

    monkeypatch.setattr(image_files, "ProcessPoolExecutor", Recording)
    monkeypatch.setattr(image_files, "CHUNK", 4)  # several chunks from a small tree
    one = run(tmp_path / "photos", tmp_path / "one", on_bad_file="skip", workers=1)
    assert started == []
    two = run(tmp_path / "photos", tmp_path / "two", on_bad_file="skip", workers=2)
    assert started == [2]
    assert two.data_sha256 == one.data_sha256
    assert two.to_dict() == one.to_dict()
    assert (tmp_path / "two" / "card.json").read_bytes() == (
        tmp_path / "one" / "card.json"
    ).read_bytes()


# ----------------------------------------------------------------------------- assign_splits


def test_assign_splits_is_stratified_with_at_least_one_each():
    sizes = {0: 10, 1: 7, 2: 23, 3: 3}
    labels = np.array([c for c, n in sizes.items() for _ in range(n)])
    labels = labels[np.random.default_rng(0).permutation(labels.size)]  # interleaved
    out = assign_splits(labels, [None] * labels.size, ("a", "b", "c", "d"), 0.2, 0.1, seed=3)
    got = {c: {s: int(((labels == c) & (out == s)).sum()) for s in SPLITS} for c in sizes}
    # val round(n * 0.2), test round(n * 0.1), each at least 1; the rest train
    assert got == {
        0: {"train": 7, "val": 2, "test": 1},
        1: {"train": 5, "val": 1, "test": 1},
        2: {"train": 16, "val": 5, "test": 2},
        3: {"train": 1, "val": 1, "test": 1},
    }


def test_assign_splits_is_seeded():
    labels = np.repeat(np.arange(3), 20)
    args = (labels, [None] * labels.size, ("a", "b", "c"), 0.2, 0.2)
    first = assign_splits(*args, seed=7)
    assert (assign_splits(*args, seed=7) == first).all()
    assert not (assign_splits(*args, seed=8) == first).all()
    assert set(first.tolist()) == set(SPLITS)


def test_assign_splits_keeps_given_splits_and_carves_only_what_is_missing():
    labels = np.array([0] * 10 + [1] * 10 + [0, 1])
    given = ["train"] * 20 + ["val", "val"]
    out = assign_splits(labels, given, ("a", "b"), 0.3, 0.2, seed=0)
    assert list(out[20:]) == ["val", "val"]
    assert int((out[:20] == "val").sum()) == 0  # val is given: not carved from train
    assert [int(((labels[:20] == c) & (out[:20] == "test")).sum()) for c in (0, 1)] == [2, 2]
    everything = ["train"] * 10 + ["val"] * 6 + ["test"] * 6
    labels = np.array([0, 1] * 11)
    assert list(assign_splits(labels, everything, ("a", "b"), 0.3, 0.2, seed=0)) == everything


def test_assign_splits_zero_fraction_carves_nothing():
    labels = np.repeat(np.arange(2), 10)
    out = assign_splits(labels, [None] * 20, ("a", "b"), 0.2, 0.0, seed=0)
    assert sorted(set(out.tolist())) == ["train", "val"]


def test_assign_splits_refuses_a_class_too_small():
    labels = np.array([0] * 10 + [1] * 2)
    with pytest.raises(DataError, match=r"class 'small' has 2 image\(s\).*least 3"):
        assign_splits(labels, [None] * 12, ("big", "small"), 0.2, 0.2, seed=0)


# ----------------------------------------------------------------------------- find_duplicates


def test_find_duplicates_reports_copies_into_val_and_test():
    pairs = [
        ("a", "train"),
        ("b", "train"),
        ("a", "val"),
        ("c", "val"),
        ("c", "test"),
        ("b", "test"),
        ("d", "test"),
        ("e", "test"),
        ("e", "val"),
        ("f", "train"),
        ("f", "train"),
        ("a", "test"),
        ("g", "val"),
        ("g", "val"),
    ]
    hashes = [h for h, _ in pairs]
    splits = np.array([s for _, s in pairs], dtype=object)
    got = find_duplicates(hashes, splits)
    assert got == {
        "val": [2],  # a: a copy of a train image
        # c and e: copies of val images (whichever comes first); b and a: of train images
        "test": [4, 5, 7, 11],
    }
    # copies within one split (f in train, g in val) are not across splits; the test copy
    # is the one reported whatever the order
    assert find_duplicates(["x", "x"], np.array(["test", "val"], dtype=object)) == {
        "val": [],
        "test": [0],
    }
    assert find_duplicates([], np.array([], dtype=object)) == {"val": [], "test": []}
