"""The LightningModule that trains any network ``build_model`` makes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.nn.functional as F

from trainyard.core.card import Card
from trainyard.model.augment import augment_batch, normalize_on_device
from trainyard.model.networks import classifier_head, net_for_card

if TYPE_CHECKING:
    from trainyard.core.config import TrainParams

AUGMENT_MODES = ("none", "shift", "flip")
# Kept per-step losses are logged at least this often, even within a long epoch.
STEP_LOSS_EVERY_S = 30.0


def augment_mode(augment: str | bool) -> str:
    """``none`` | ``shift`` | ``flip`` (shift + horizontal flip); checkpoints of earlier
    versions hold a bool (True was shift + flip)."""
    if isinstance(augment, bool):
        return "flip" if augment else "none"
    if augment not in AUGMENT_MODES:
        raise ValueError(f"augment must be one of {AUGMENT_MODES}, got {augment!r}")
    return augment


class Classifier(L.LightningModule):
    """Trains any ``build_model`` net on uint8 batches, normalising them on the device.

    ``card``: the dataset card's contract (``Card.contract()``, a plain dict) - classes,
    channels, size and per-channel mean/std. It is saved in the checkpoint's
    hyperparameters (plain types only, so ``torch.load(..., weights_only=True)`` reads it)
    and is all that is needed to rebuild the net: ``Classifier(**ckpt["hyper_parameters"])``.
    ``pretrained`` is deliberately *not* saved: it only initialises the weights, which the
    checkpoint's state dict then replaces, and the file may not exist where the checkpoint
    is exported. ``self.pretrained_info`` says which weights were used (see ``build_model``).
    """

    def __init__(
        self,
        card: dict[str, Any] | Card,
        arch: str = "cnn",
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        label_smoothing: float = 0.1,
        augment: str | bool = "flip",
        seed: int = 0,
        channels_last: bool = False,
        compile: bool = False,
        pretrained: str | None = None,
        finetune: bool = False,
        freeze_epochs: int = 1,
        frozen_stages: int = 0,
        pretrained_info: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        parsed = card if isinstance(card, Card) else Card.from_dict(card, "Classifier card")
        # Stored as the contract's plain dict (lists, not tuples or a Card): checkpoints
        # stay loadable with weights_only=True. save_hyperparameters reads this local.
        card = parsed.contract()
        self.net = net_for_card(parsed, arch, pretrained)
        # Which weights the fit started from travels with the checkpoint (export writes it
        # into the ONNX metadata); rebuilt from a checkpoint, the saved value stands.
        self.pretrained_info: dict[str, str] = dict(
            self.net.pretrained_info or pretrained_info or {}
        )
        pretrained_info = self.pretrained_info
        self.save_hyperparameters(ignore=["pretrained"])
        self.card = parsed
        # Buffers follow the module to the device (no host->device copy per batch); not
        # persistent, so the state dict holds only the net and the card stays the truth.
        self.register_buffer(
            "pixel_mean", torch.tensor(parsed.mean).reshape(1, -1, 1, 1), persistent=False
        )
        self.register_buffer(
            "pixel_std", torch.tensor(parsed.std).reshape(1, -1, 1, 1), persistent=False
        )
        if channels_last:  # NHWC: what cuDNN's tensor-core convolutions want
            self.net = self.net.to(memory_format=torch.channels_last)
        self._aug_gen: torch.Generator | None = None
        self._step_losses: list[tuple[int, torch.Tensor]] = []
        self._step_losses_since = 0.0

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
        """Logits for *normalised* float input [B,C,H,W] (the exported ONNX contract)."""
        return self.net(x)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Runs on the device: uint8 crosses the bus (4x fewer bytes), floats are made there.
        images, labels = batch
        x = normalize_on_device(images, self.pixel_mean, self.pixel_std)
        mode = augment_mode(self.hparams.augment)
        if self.trainer.training and mode != "none":
            x = augment_batch(x, self._generator(x.device), flip=mode == "flip")
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, labels

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        acc = (logits.argmax(1) == y).float().mean()
        n = y.shape[0]
        if stage == "train":
            # No value leaves the device during an epoch: on a GPU a read-back (.item(),
            # which Lightning does for every on_step or progress-bar value it logs or draws)
            # waits for every queued kernel, and the GPU idles while Python launches the
            # next step. Epoch means accumulate on the device (read once, at epoch end);
            # the per-step loss is kept there and logged in bulk (keep_step_loss). Rank 0's
            # shard under DDP, not synced: syncing would cost a collective per metric.
            self.log(
                "train/loss_epoch", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=n
            )
            self.log("train/acc", acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=n)
            self.keep_step_loss(loss)
            return loss
        # Under DDP each rank sees its own shard: val/test epoch metrics (what checkpoints
        # and early stopping watch) are averaged over ranks.
        for name, value in (("loss", loss), ("acc", acc)):
            self.log(
                f"{stage}/{name}", value, on_epoch=True, prog_bar=True, batch_size=n, sync_dist=True
            )
        return loss

    def keep_step_loss(self, loss: torch.Tensor) -> None:
        """Keep this step's loss (every ``log_every_n_steps``-th step, the steps Lightning
        would log) on the device, for ``train/loss_step``; logged by ``log_step_losses``
        at the epoch's end, at a checkpoint, or when the oldest kept is STEP_LOSS_EVERY_S
        old (a long epoch still shows its curve as it goes): one read-back for all."""
        trainer = self._trainer
        if trainer is None or not trainer.loggers or not trainer.is_global_zero:
            return  # nothing to log to (rank 0 logs)
        if not trainer.log_every_n_steps:
            return
        step = self.global_step  # optimizer steps before this one: Lightning's x for it
        if (step + 1) % trainer.log_every_n_steps:
            return
        if not self._step_losses:
            self._step_losses_since = time.monotonic()
        self._step_losses.append((step, loss.detach()))
        if time.monotonic() - self._step_losses_since >= STEP_LOSS_EVERY_S:
            self.log_step_losses()

    def log_step_losses(self) -> None:
        """Log the kept per-step losses as ``train/loss_step`` to the trainer's loggers."""
        if not self._step_losses:
            return
        steps = [step for step, _ in self._step_losses]
        values = torch.stack([v.float() for _, v in self._step_losses]).tolist()
        self._step_losses = []
        for logger in self.loggers:
            for step, value in zip(steps, values, strict=True):
                logger.log_metrics({"train/loss_step": value}, step=step)

    def on_train_epoch_end(self) -> None:
        self.log_step_losses()

    def on_train_end(self) -> None:
        self.log_step_losses()  # an epoch cut short (max_steps, max_time)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A fit resumed from this checkpoint redoes the steps after it, not these.
        self.log_step_losses()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def _frozen_modules(self) -> list[torch.nn.Module]:
        """The front ``frozen_stages`` stages of the net (``net.stages()``), frozen for the
        whole fit: what a fine-tune on a CPU keeps as ImageNet left it."""
        n = int(self.hparams.get("frozen_stages", 0))
        if not n or not hasattr(self.net, "stages"):
            return []
        return [m for stage in self.net.stages()[:n] for m in stage]

    def _param_groups(
        self,
    ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """(frozen for the whole fit, the pretrained body that trains, the new head: the
        last Linear layer)."""
        found = classifier_head(self.net)
        assert found is not None, "every net build_model makes ends in a Linear head"
        head = found[1]
        head_ids = {id(p) for p in head.parameters()}
        frozen = [p for m in self._frozen_modules() for p in m.parameters()]
        frozen_ids = {id(p) for p in frozen}
        body = [
            p for p in self.net.parameters() if id(p) not in head_ids and id(p) not in frozen_ids
        ]
        return frozen, body, list(head.parameters())

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        # A frozen stage keeps ImageNet's BatchNorm statistics: in train mode its running
        # means would drift to this data's batches while its weights stay put.
        for module in self._frozen_modules():
            module.eval()
        return self

    def on_train_epoch_start(self) -> None:
        # fastai's fine_tune: the new head learns alone for freeze_epochs (the body's random
        # head gradients would wreck the pretrained features), then the body trains too.
        if self.hparams.finetune:
            self.train(self.training)  # Lightning never calls train(): the frozen go to eval
            frozen, body, _ = self._param_groups()
            for p in frozen:
                p.requires_grad_(False)  # no gradient: no activations kept for them either
            warm = self.current_epoch < self.hparams.freeze_epochs
            for p in body:
                p.requires_grad_(not warm)

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        if self.hparams.finetune:
            # Discriminative rates: the pretrained body moves at a tenth of the head's.
            _, body, head = self._param_groups()
            groups: Any = [{"params": body, "lr": lr / 10}, {"params": head, "lr": lr}]
            max_lr: Any = [lr / 10, lr]
        else:
            groups, max_lr = self.parameters(), lr
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt,
            max_lr=max_lr,
            # OneCycle needs a few steps per phase; tiny runs (tests, benchmarks) get a floor.
            total_steps=max(int(self.trainer.estimated_stepping_batches), 8),
            pct_start=0.25,
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def classifier_for(
    tp: TrainParams, card: Card, seed: int = 0, finetune: bool = False, frozen_stages: int = 0
) -> Classifier:
    """The classifier ``train.*`` describes (resolved: no ``auto`` left) for the data
    ``card`` describes: what the train stage fits and the benchmarks time. ``finetune``:
    the pretrained body is frozen for the first epoch, then trains at a tenth of the
    head's rate; ``frozen_stages``: that many of its front stages stay frozen throughout."""
    return Classifier(
        card=card.contract(),
        arch=tp.arch,
        lr=tp.lr,
        weight_decay=tp.weight_decay,
        label_smoothing=tp.label_smoothing,
        augment=tp.augment,
        channels_last=tp.channels_last,
        compile=tp.compile,
        seed=seed,
        pretrained=tp.pretrained,
        finetune=finetune,
        frozen_stages=frozen_stages,
    )
