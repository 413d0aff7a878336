"""Networks and the LightningModule that trains them.

Conv -> BatchNorm2d -> ReLU blocks throughout: ONNX Runtime folds BatchNorm2d into the conv
at inference, so the exported graph is as lean as the trained one.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from trainyard.dataset import IMAGE_SIZE, NUM_CLASSES


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """~0.5M params, sized for 2 CPU cores: 3 conv blocks and a dense head.

    A flatten+dense head rather than global pooling: Fashion-MNIST items are centred, so
    *where* a feature is (collar, sole, strap) carries class information.
    """

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_bn(1, w),
            nn.MaxPool2d(2),  # 28 -> 14
            conv_bn(w, 2 * w),
            nn.MaxPool2d(2),  # 14 -> 7
            conv_bn(2 * w, 2 * w),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(2 * w * 7 * 7, 128),
            nn.ReLU(inplace=True),
            nn.Dropout(0.3),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(cin, cout, stride)
        self.conv2 = nn.Sequential(
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)
        )
        self.short = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(self.conv1(x)) + self.short(x))


class ResNet(nn.Module):
    """A wide ResNet-style net (~2.8M params) for GPUs, where compute is cheap."""

    def __init__(self, num_classes: int = NUM_CLASSES, widths: tuple[int, ...] = (64, 128, 256)):
        super().__init__()
        layers: list[nn.Module] = [conv_bn(1, widths[0])]
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, w, stride), BasicBlock(w, w, 1)]
            cin = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


ARCHITECTURES = {"cnn": SmallCNN, "resnet": ResNet}


def build_model(arch: str) -> nn.Module:
    try:
        return ARCHITECTURES[arch]()
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}") from None


def normalize(images_u8: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 [B,1,H,W] in 0..255 -> float32 normalised; the model's input contract."""
    return (images_u8.float() / 255.0 - mean) / std


def augment_batch(
    x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 2
) -> torch.Tensor:
    """Random translate (zero pad + crop) and horizontal flip on a whole batch, on its device.

    One gather for the whole batch instead of per-sample PIL ops: cost is a few
    elementwise kernels regardless of batch size.
    """
    b, _, h, w = x.shape
    dev = x.device
    shifts = torch.randint(0, 2 * pad + 1, (2, b), generator=generator, device=dev)
    flips = torch.rand(b, generator=generator, device=dev) < 0.5
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (shifts[0][:, None] + torch.arange(h, device=dev))[:, :, None]  # [B,H,1]
    cols = shifts[1][:, None] + torch.arange(w, device=dev)  # [B,W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, :]  # [B,1,W]
    bidx = torch.arange(b, device=dev)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[bidx, rows, cols]  # [B,H,W,C]
    return out.permute(0, 3, 1, 2).contiguous()


class Classifier(L.LightningModule):
    """Trains any ``build_model`` net on uint8 batches, normalising them on the device."""

    def __init__(
        self,
        arch: str = "cnn",
        lr: float = 3e-3,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.1,
        augment: bool = True,
        mean: float = 0.2860,
        std: float = 0.3530,
        seed: int = 0,
        image_size: int = IMAGE_SIZE,
        num_classes: int = NUM_CLASSES,
        channels_last: bool = False,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_model(arch)
        if channels_last:  # NHWC: what cuDNN's tensor-core convolutions want
            self.net = self.net.to(memory_format=torch.channels_last)
        self._aug_gen: torch.Generator | None = None

    def configure_model(self) -> None:
        # nn.Module.compile() compiles in place: state_dict keys (and export) are unchanged.
        if self.hparams.compile:
            self.net.compile()

    def _generator(self, device: torch.device) -> torch.Generator:
        # Random numbers drawn on the batch's own device: no host round-trip per batch.
        if self._aug_gen is None or self._aug_gen.device != device:
            self._aug_gen = torch.Generator(device=device).manual_seed(self.hparams.seed)
        return self._aug_gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for *normalised* float input [B,1,H,W] (the exported ONNX contract)."""
        return self.net(x)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Runs on the device: uint8 crosses the bus (4x fewer bytes), floats are made there.
        images, labels = batch
        x = normalize(images, self.hparams.mean, self.hparams.std)
        if self.trainer.training and self.hparams.augment:
            x = augment_batch(x, self._generator(x.device))
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, labels

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        acc = (logits.argmax(1) == y).float().mean()
        on_step = stage == "train"
        # Under DDP each rank sees its own shard: epoch metrics of val/test (what checkpoints
        # and early stopping watch) are averaged over ranks; per-step train loss is not
        # (a sync every step would cost more than it tells).
        sync = stage != "train"
        self.log(
            f"{stage}/loss",
            loss,
            on_step=on_step,
            on_epoch=True,
            prog_bar=True,
            batch_size=y.shape[0],
            sync_dist=sync,
        )
        self.log(
            f"{stage}/acc",
            acc,
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            batch_size=y.shape[0],
            sync_dist=sync,
        )
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt,
            max_lr=self.hparams.lr,
            # OneCycle needs a few steps per phase; tiny runs (tests, benchmarks) get a floor.
            total_steps=max(int(self.trainer.estimated_stepping_batches), 8),
            pct_start=0.25,
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
