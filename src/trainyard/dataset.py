"""Fashion-MNIST: the one definition of its files, checksums, classes and input contract."""

from __future__ import annotations

from dataclasses import dataclass

CLASS_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SIZE = 28
INPUT_SHAPE = (1, IMAGE_SIZE, IMAGE_SIZE)  # C, H, W of one image; the batch dim is dynamic


@dataclass(frozen=True)
class RawFile:
    """One IDX .gz file of the dataset.

    ``content_sha256`` is the hash of the *decompressed* IDX bytes. Debian's
    dataset-fashion-mnist repacks the .gz files (no name, new mtime in the gzip header), so
    their .gz bytes differ from upstream's while the content is identical; hashing the
    content accepts both and still catches any changed or truncated byte.
    ``upstream_gz_md5`` is the MD5 published upstream for the .gz as downloaded.
    """

    name: str
    split: str  # "train" or "test"
    kind: str  # "images" or "labels"
    count: int
    content_sha256: str
    content_size: int
    upstream_gz_md5: str


RAW_FILES: tuple[RawFile, ...] = (
    RawFile(
        "train-images-idx3-ubyte.gz",
        "train",
        "images",
        60_000,
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        47_040_016,
        "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    ),
    RawFile(
        "train-labels-idx1-ubyte.gz",
        "train",
        "labels",
        60_000,
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        60_008,
        "25c81989df183df01b3e8a0aad5dffbe",
    ),
    RawFile(
        "t10k-images-idx3-ubyte.gz",
        "test",
        "images",
        10_000,
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        7_840_016,
        "bef4ecab320f06d8554ea6380940ec79",
    ),
    RawFile(
        "t10k-labels-idx1-ubyte.gz",
        "test",
        "labels",
        10_000,
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
        10_008,
        "bb300cfdad3c16e7a12a480ee83cd310",
    ),
)
RAW_BY_NAME = {f.name: f for f in RAW_FILES}
