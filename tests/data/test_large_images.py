"""Large images are training data, not bombs: a user's 150-600 MP poster is prepared within
bounded memory (a PNG reduced band by band as it is inflated, anything else box-reduced
before any conversion, and prepare's workers under one budget of decoded bytes), limits are
ours (data.max_image_pixels for prepare, serve.max_image_pixels for the service), never
Pillow's own guard."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import time
import zlib
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
from image_bytes import encode, png_claiming
from PIL import Image

from trainyard.core import imaging
from trainyard.core.card import SPLITS
from trainyard.core.config import DataParams
from trainyard.core.errors import InputError
from trainyard.core.imaging import image_to_pixels, read_header
from trainyard.core.png_bands import png_bands, png_layout
from trainyard.data import decode_budget, image_files
from trainyard.data.sources import prepare_source as prepare

SIDE = 12288  # 151 MP RGBA: 604 MB decoded; the old float32 conversion needed over 2.4 GB more
DECODED = SIDE * SIDE * 4
# What image_to_pixels may add to the decoded image (strips, the reduced copy, numpy), and
# all a streamed PNG may take (bands: 22-26 MiB measured for the 151 MP poster).
HEADROOM = 256 * 2**20
POSTER_SIDE = 24960  # 623 MP, as the largest PNG in Debian's openclipart-png


def chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def poster_png(side: int = SIDE, depth: int = 8) -> bytes:
    """A real side x side RGBA PNG, written row by row (cheap): transparent *red* around an
    opaque green square covering the middle half. Red must never show after compositing.
    ``depth`` 16 stores each sample as 16 bits (Pillow then decodes it whole)."""
    top = 2**depth - 1
    clear = np.zeros((side, 4), ">u2" if depth == 16 else np.uint8)
    clear[:, 0] = top
    band = clear.copy()
    band[side // 4 : 3 * side // 4] = (0, 200 * top // 255, 0, top)
    rows = (b"\0" + clear.tobytes(), b"\0" + band.tobytes())
    z = zlib.compressobj(1)
    idat = [z.compress(rows[side // 4 <= y < 3 * side // 4]) for y in range(side)]
    idat.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", side, side, depth, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", b"".join(idat))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def poster(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("large") / "poster.png"
    path.write_bytes(poster_png())
    return path


@pytest.fixture(scope="module")
def poster16(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("large") / "poster16.png"
    path.write_bytes(poster_png(depth=16))
    return path


MEASURE = r"""
import json, resource, sys
from trainyard.core.imaging import image_to_pixels
data = open(sys.argv[1], "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = image_to_pixels(data, channels=3, height=64, width=64, resize=sys.argv[2],
                      max_pixels=10**9, limit_key="data.max_image_pixels")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "out": out.tolist()}))
"""


@pytest.mark.parametrize(
    ("depth", "bound"),
    [(8, HEADROOM), (16, DECODED + HEADROOM)],
    ids=["8-bit-streamed", "16-bit-whole"],
)
@pytest.mark.parametrize("resize", ["crop", "pad"])
def test_a_150_mp_rgba_png_decodes_in_bounded_memory(poster, poster16, resize, depth, bound):
    # A fresh process: ru_maxrss is its own peak, nothing earlier in pytest counts.
    path = poster if depth == 8 else poster16
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), resize],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(proc.stdout)
    grown = got["peak"] - got["base"]
    assert grown <= bound, (
        f"image_to_pixels grew by {grown / 2**20:.0f} MiB for a {DECODED / 2**20:.0f} MiB "
        "decoded image: "
        + ("the PNG was decoded whole" if depth == 8 else "a full-size conversion is back")
    )
    out = np.asarray(got["out"], dtype=np.uint8)
    assert out.shape == (3, 64, 64)
    assert out[0].max() == 0  # transparent red composited as fill 0: no red bled in
    if resize == "crop":  # the middle half is green, the corners transparent
        assert (out[:, 24:40, 24:40].transpose(1, 2, 0) == (0, 200, 0)).all()
        assert (out[:, :8, :8] == 0).all()


def small_folder(root: Path) -> Path:
    """Two classes of five small solid images: the rest of a folder a poster joins."""
    for c, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (80, 60), colour).save(root / f"class{c}" / f"{i}.png")
    return root


def test_prepare_accepts_a_large_image_of_the_users_own(poster, tmp_path):
    root = small_folder(tmp_path / "photos")
    (root / "class0" / "poster.png").symlink_to(poster)
    params = DataParams(
        source="folder",
        folder=str(root),
        image_size=32,
        val_fraction=0.2,
        test_fraction=0.2,
        workers=1,
        on_bad_file="error",
    )
    card = prepare("unused", tmp_path / "out", params, seed=0)
    assert card.skipped == ()
    assert sum(c["total"] for c in card.counts.values()) == 11
    images = np.concatenate([np.load(tmp_path / "out" / f"{s}_images.npy") for s in card.counts])
    # the poster's row: green centre, fill around it (and no red from its transparent pixels)
    green = [r for r in images if (r[:, 14:18, 14:18].transpose(1, 2, 0) == (0, 200, 0)).all()]
    assert len(green) == 1 and green[0][0].max() == 0


def test_the_limit_named_is_the_one_that_applies():
    data = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 9, 9)).save(data, "PNG")
    with pytest.raises(InputError) as info:
        image_to_pixels(data.getvalue(), channels=3, height=8, width=8, max_pixels=1000)
    assert info.value.status == 413
    assert "(serve.max_image_pixels). Downscale it first" in str(info.value)
    with pytest.raises(InputError) as info:
        read_header(data.getvalue(), max_pixels=1000, limit_key="data.max_image_pixels")
    assert "(data.max_image_pixels)" in str(info.value) and "raise data.max_image_pixels" in str(
        info.value
    )


def test_pillows_own_bomb_guard_does_not_pre_empt_our_limit():
    # 900 MP: over Pillow's 2 x 89 MP guard, under a 1 GP data.max_image_pixels.
    claim = png_claiming(30000, 30000)
    header = read_header(claim, max_pixels=10**9, max_aspect_ratio=float("inf"))
    assert (header.width, header.height) == (30000, 30000)
    with pytest.raises(InputError) as info:  # our limit let it through: its data is short
        image_to_pixels(claim, channels=1, height=8, width=8, max_pixels=10**9)
    assert info.value.status == 400 and "truncated" in str(info.value)


# ----------------------------------------------------------------------------- the reduce


def px(data: bytes, channels: int = 3, height: int = 32, width: int = 32, **kw) -> np.ndarray:
    return image_to_pixels(data, channels=channels, height=height, width=width, **kw)


@pytest.mark.parametrize("fill", [0, 255])
def test_reduced_alpha_is_premultiplied_so_transparent_colour_never_bleeds(fill):
    a = np.zeros((1000, 1000, 4), np.uint8)
    a[..., 0] = 255  # transparent red everywhere ...
    a[::2, ::2] = (0, 255, 0, 255)  # ... under a quarter-coverage opaque green lattice
    out = px(encode(Image.fromarray(a, "RGBA")), fill=fill)
    green = 255 / 4 + fill * 3 / 4
    assert np.abs(out[1].astype(float) - green).max() <= 2
    assert np.abs(out[0].astype(float) - fill * 3 / 4).max() <= 2  # red: only the fill's


def test_reduced_palette_and_la_transparency_composite_on_fill():
    p = Image.fromarray((np.indices((1000, 1000)).sum(0) % 2).astype(np.uint8), "P")
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)  # index 0 (red) is transparent
    out = px(encode(p, transparency=0))
    assert out[0].max() <= 1 and np.abs(out[1].astype(int) - 128).max() <= 2
    la = np.zeros((1000, 1000, 2), np.uint8)
    la[..., 0] = 255  # transparent white rows between opaque grey ones
    la[::2, :] = (100, 255)
    out = px(encode(Image.fromarray(la, "LA")), channels=1)
    assert np.abs(out.astype(int) - 50).max() <= 1


def test_reduce_then_resize_matches_a_direct_resize():
    y, x = np.mgrid[0:900, 0:1200]
    rgb = np.stack([x * 255 // 1199, y * 255 // 899, (x + y) % 256], axis=2).astype(np.uint8)
    direct = np.asarray(Image.fromarray(rgb).resize((40, 30), Image.Resampling.BILINEAR))
    out = px(encode(Image.fromarray(rgb)), height=30, width=40, resize="stretch")
    assert np.abs(out.transpose(1, 2, 0).astype(int) - direct).mean() < 2.0


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_rotation_of_a_large_image_turns_the_reduced_one(fmt):
    im = Image.new("RGB", (2000, 1000), (128, 128, 128))
    im.paste((255, 0, 0), (0, 0, 400, 400))  # stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: the red block at the top right
    out = px(encode(im, fmt, exif=exif), height=64, width=32, resize="stretch")
    assert out.shape == (3, 64, 32)
    assert out[0, :8, -8:].min() > 200 and out[1, :8, -8:].max() < 40
    assert np.abs(out[:, -8:, :8].astype(int) - 128).max() <= 3


# ----------------------------------------------------------------------------- streamed PNG

SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # samples per pixel, by PNG colour type


def filtered_png(
    rows: np.ndarray, width: int, depth: int, colour: int, filters: list[int], extra: bytes = b""
) -> bytes:
    """A PNG of ``rows`` (uint8 [h, bytes]: packed samples) written by hand, row y stored
    with filter ``filters[y % len(filters)]`` (0 none, 1 sub, 2 up, 3 average, 4 paeth):
    Pillow's own encoder chooses its filters itself. ``extra``: chunks before IDAT."""
    h, n = rows.shape
    bpp = max(1, depth * SAMPLES[colour] // 8)
    a = rows.astype(np.int16)
    up = np.vstack([np.zeros((1, n), np.int16), a[:-1]])
    left = np.hstack([np.zeros((h, bpp), np.int16), a[:, :-bpp]])
    corner = np.hstack([np.zeros((h, bpp), np.int16), up[:, :-bpp]])
    p = left + up - corner
    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - corner)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, corner))
    predict = [np.zeros_like(a), left, up, (left + up) // 2, paeth]
    raw = b"".join(
        bytes([f]) + ((a[y] - predict[f][y]) % 256).astype(np.uint8).tobytes()
        for y in range(h)
        for f in [filters[y % len(filters)]]
    )
    ihdr = struct.pack(">IIBBBBB", width, h, depth, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + extra
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


MIXED = [0, 1, 2, 3, 4, 4, 3, 2, 1]  # every filter, next to every other, across band edges


@pytest.mark.parametrize(
    ("depth", "colour", "filters"),
    [(8, 6, [f]) for f in range(5)]
    + [(8, c, MIXED) for c in (0, 2, 3, 4, 6)]
    + [(d, c, MIXED) for d in (1, 2, 4) for c in (0, 3)],
)
def test_bands_decode_as_pillow_decodes_the_whole_file(depth, colour, filters):
    rng = np.random.default_rng(depth * 10 + colour)
    width = 53 if depth == 8 else 56  # below 8 bits, rows with padding bits are not streamed
    rows = rng.integers(0, 256, (41, -(-width * SAMPLES[colour] * depth // 8)), dtype=np.uint8)
    rows[10:20] = rows[9]  # runs of equal rows, as drawings have
    if colour == 3:  # a full palette (any index is in it), its last two entries transparent
        palette = chunk(b"PLTE", rng.integers(0, 256, 3 * 2**depth, dtype=np.uint8).tobytes())
        extra = palette + chunk(b"tRNS", bytes([255] * (2**depth - 2) + [0, 128]))
    else:
        extra = b""
    data = filtered_png(rows, width, depth, colour, filters, extra)
    whole = Image.open(io.BytesIO(data))
    layout = png_layout(data)
    assert layout is not None
    bands = list(png_bands(data, layout, 4))
    assert [top for top, _, _ in bands] == list(range(0, 41, 4))
    got = np.concatenate([np.asarray(band)[skip:] for _, band, skip in bands])
    assert np.array_equal(got, np.asarray(whole))
    assert all(band.mode == whole.mode and band.info == whole.info for _, band, _ in bands)


def noisy(mode: str, size: tuple[int, int] = (704, 500)) -> Image.Image:
    """Structure (a gradient, a block) under noise: a row out of place shows after the reduce."""
    rng = np.random.default_rng(7)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    rgba = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256, 255 - x * 200 // w], axis=2)
    rgba = rgba + rng.integers(-40, 40, rgba.shape)
    rgba[h // 3 : h // 2, w // 4 : w // 2] = (250, 10, 10, 0)  # a transparent block
    im = Image.fromarray(np.clip(rgba, 0, 255).astype(np.uint8), "RGBA")
    if mode in ("P", "P4"):
        return im.convert("RGB").quantize(16 if mode == "P4" else 200)
    return im.convert(mode)


MODES = [  # (mode, save options)
    ("RGB", {}),
    ("RGBA", {}),
    ("L", {}),
    ("LA", {}),
    ("1", {}),
    ("P", {}),
    ("P", {"transparency": 3}),
    ("P4", {"bits": 4, "transparency": 1}),
    ("L", {"transparency": 128}),
    ("RGB", {"transparency": (250, 10, 10)}),
]


@pytest.mark.parametrize(("mode", "options"), MODES, ids=[f"{m}{o}" for m, o in MODES])
def test_a_streamed_png_gives_the_pixels_of_the_whole_decode(monkeypatch, mode, options):
    data = encode(noisy(mode), **options)
    calls = [(3, "crop"), (1, "pad"), (3, "stretch")]
    whole = [px(data, channels=c, resize=policy) for c, policy in calls]
    streamed = []
    real = imaging.png_bands
    monkeypatch.setattr(imaging, "STREAM_PIXELS", 0)  # this small image streams too,
    monkeypatch.setattr(imaging, "_BAND_BYTES", 1)  # in bands of one box of rows each
    monkeypatch.setattr(imaging, "png_bands", lambda *a: streamed.append(1) or real(*a))
    again = [px(data, channels=c, resize=policy) for c, policy in calls]
    assert len(streamed) == len(calls), "the streamed path was not taken"
    # Bands hold whole reduce boxes: the same reduce of the same rows, so no rounding at all.
    for a, b in zip(whole, again, strict=True):
        assert np.array_equal(a, b)


def test_a_streamed_png_is_turned_by_an_exif_chunk_after_its_image_data(monkeypatch):
    im = Image.new("RGB", (600, 300), (128, 128, 128))
    im.paste((255, 0, 0), (0, 0, 120, 120))  # stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: the red block at the top right
    plain = encode(im)
    end = plain.rindex(b"IEND") - 4  # eXIf after IDAT, where Pillow looks only by loading
    data = plain[:end] + chunk(b"eXIf", exif.tobytes()) + plain[end:]
    whole = px(data, height=64, width=32, resize="stretch")
    monkeypatch.setattr(imaging, "STREAM_PIXELS", 0)
    monkeypatch.setattr(imaging, "_BAND_BYTES", 1)
    streamed = px(data, height=64, width=32, resize="stretch")
    assert np.array_equal(whole, streamed)
    assert streamed[0, :8, -8:].min() > 200 and streamed[1, :8, -8:].max() < 40


def test_a_truncated_or_corrupt_streamed_png_is_a_400(monkeypatch):
    monkeypatch.setattr(imaging, "STREAM_PIXELS", 0)
    data = encode(noisy("RGB"))
    idat = data.index(b"IDAT") + 4
    corrupt = bytearray(data)
    corrupt[idat + 5000 : idat + 5100] = bytes(100)  # zeros in the middle of the stream
    for bad in (data[: len(data) * 2 // 3], bytes(corrupt)):
        with pytest.raises(InputError) as info:
            px(bad, field="file")
        assert info.value.status == 400
        assert str(info.value).startswith("file: the PNG image is truncated or corrupt")


def test_interlaced_16_bit_animated_and_padded_pngs_are_decoded_whole():
    plain = encode(noisy("RGB", (64, 48)))
    interlaced = bytearray(plain)
    interlaced[28] = 1  # IHDR's interlace byte (the CRC is not read here)
    sixteen = encode(Image.fromarray(np.full((48, 64), 4000, np.uint16)))
    frames = [noisy("RGB", (64, 48)), Image.new("RGB", (64, 48))]
    animated = encode(frames[0], save_all=True, append_images=frames[1:])
    padded = filtered_png(np.zeros((4, 7), np.uint8), 53, 1, 0, [2])  # 53 bits + 3 padding
    assert png_layout(plain) is not None
    assert png_layout(bytes(interlaced)) is None
    assert png_layout(padded) is None
    assert png_layout(sixteen) is None
    assert png_layout(animated) is None


# ----------------------------------------------------------------------------- decode budget


def held(cost: int, seconds: float) -> tuple[float, float]:
    """A pool task: hold ``cost`` bytes of the worker's budget for ``seconds``."""
    with decode_budget.reserve(cost):
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()


@pytest.mark.parametrize(("budget_mib", "apart"), [(100, True), (200, False)])
def test_the_pool_decodes_large_images_apart_when_together_they_exceed_the_budget(
    monkeypatch, budget_mib, apart
):
    monkeypatch.setattr(image_files, "DECODE_BUDGET", budget_mib << 20)
    pool = image_files.FilePool(2)
    try:
        (a0, a1), (b0, b1) = pool.map(held, [(80 << 20, 1.0), (80 << 20, 1.0)])
    finally:
        pool.close()
    overlap = min(a1, b1) - max(a0, b0)
    if apart:  # 2 x 80 MiB > 100 MiB: one waited for the other
        assert overlap <= 0
    else:  # they fit together: neither waited
        assert overlap > 0.5


def test_an_image_over_the_whole_budget_still_decodes_alone():
    budget = decode_budget.DecodeBudget(100)
    with budget.hold(10):
        pass
    with budget.hold(10**9):  # held as the whole budget
        assert budget.peak == 100
    assert budget.peak == 100


def test_prepare_reserves_a_whole_decode_but_not_a_streamed_png(monkeypatch, tmp_path):
    side = 4200  # 17.6 MP: decoded whole 70 MB, over decode_budget.SMALL
    Image.new("RGB", (side, side), (10, 200, 10)).save(tmp_path / "big.tiff")
    Image.new("RGB", (side, side), (10, 10, 200)).save(tmp_path / "big.png", compress_level=1)

    costs = []

    class Recorder:
        def hold(self, cost):
            costs.append(cost)
            return nullcontext()

    monkeypatch.setattr(decode_budget, "_installed", Recorder())
    params = DataParams(source="folder", folder=str(tmp_path), image_size=32)
    spec = image_files.decode_spec(params, 3, 10**9, (32, 32))
    array = tmp_path / "images.npy"
    np.lib.format.open_memmap(array, mode="w+", dtype=np.uint8, shape=(2, 3, 32, 32)).flush()
    paths = [str(tmp_path / "big.tiff"), str(tmp_path / "big.png")]
    assert image_files.decode_files(str(array), [0, 1], paths, spec) == []
    assert len(costs) == 1 and costs[0] >= 4 * side * side  # the TIFF's, decoded whole
    images = np.load(array)
    assert (images[0, :, 16, 16] == (10, 200, 10)).all()
    assert (images[1, :, 16, 16] == (10, 10, 200)).all()


PREPARE = r"""
import sys
from trainyard.core.config import DataParams
from trainyard.data import image_files
from trainyard.data.sources import prepare_source
image_files.CHUNK = 4  # a pool of two workers for this small folder, as a large one gets
params = DataParams(source="folder", folder=sys.argv[1], image_size=32, val_fraction=0.2,
                    test_fraction=0.2, workers=2, on_bad_file="error")
card = prepare_source("unused", sys.argv[2], params, seed=0)
assert not card.skipped, card.skipped
"""
# prepare is started from this small launcher, not from pytest: a process's ru_maxrss
# starts at the high-water mark of the process that started it (Linux carries it across
# exec), and pytest's is far above the limit measured here. RUSAGE_CHILDREN: the prepare
# process and its pool's workers, each waited for.
LAUNCH = r"""
import resource, subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_prepare_of_a_folder_with_a_623_mp_poster_stays_under_2_gib(tmp_path):
    root = small_folder(tmp_path / "photos")
    (root / "class0" / "poster.png").write_bytes(poster_png(POSTER_SIDE))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, PREPARE, str(root), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    peak = int(proc.stdout.strip().splitlines()[-1])
    print(
        f"prepare of a folder with a {POSTER_SIDE}x{POSTER_SIDE} RGBA PNG: peak RSS "
        f"{peak / 2**20:,.0f} MiB in {time.perf_counter() - start:.1f} s"
    )
    assert peak <= 2 * 2**30, "prepare held the poster (2.5 GB decoded) whole"
    images = np.concatenate([np.load(tmp_path / "out" / f"{s}_images.npy") for s in SPLITS])
    # The poster's row: green at its centre (198 at 32 px, as when decoded whole), black
    # fill around it, and no red from its transparent pixels.
    poster = [r for r in images if r[1, 16, 16] > 150]
    assert len(poster) == 1
    centre = poster[0][:, 14:18, 14:18].transpose(1, 2, 0).astype(int)
    assert np.abs(centre - (0, 200, 0)).max() <= 3
    assert poster[0][0].max() == 0 and (poster[0][:, :4, :4] == 0).all()
