"""The training recipe (train.recipe): each auto key's choice and its reason, the user's keys
winning, the classic defaults, the flip rule on real arrays, the time budget, and the
fastai-style fine-tune of a local state-dict file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard.core.card import Card
from trainyard.core.config import Params, parse_params
from trainyard.data.prepared_writer import open_prepared
from trainyard.training import batch_rule, recipe, speed
from trainyard.training.batch_rule import choose_batch
from trainyard.training.builder import HARD_STOP, time_limit_min
from trainyard.training.recipe import CLASSIC, Facts, choose_epochs, load_plan, plan

from conftest import make_card


def _card(classes: int, channels: int, size: int) -> Card:
    return make_card(
        classes, (channels, size, size), 0.0, 1.0, resize="crop", fill=0, interpolation="bilinear"
    )


def _prepared(
    out: Path, train: np.ndarray, ytrain: np.ndarray, val: np.ndarray, yval: np.ndarray
) -> Card:
    """A real prepared folder (the store's writer) holding these splits; test = val."""
    c, size = train.shape[1], train.shape[2]
    card = _card(int(ytrain.max()) + 1, c, size)
    with open_prepared(out) as w:
        for split, (x, y) in {
            "train": (train, ytrain),
            "val": (val, yval),
            "test": (val, yval),
        }.items():
            w.write_images(split, x)
            w.write_labels(split, y)
        return w.finish(card)


def _arrows(n: int, size: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two classes that are each other's mirror image: a bar on the left or the right half,
    with noise. Flipping turns one class into the other."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 40, (n, 1, size, size)).astype(np.uint8)
    for i, label in enumerate(y):
        cols = slice(1, size // 3) if label == 0 else slice(size - size // 3, size - 1)
        x[i, 0, 2:-2, cols] = 220
    return x, y


def _rings(n: int, size: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two mirror-symmetric classes: a small or a large centred square outline."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 40, (n, 1, size, size)).astype(np.uint8)
    for i, label in enumerate(y):
        r = 3 if label == 0 else 6
        lo, hi = size // 2 - r, size // 2 + r
        x[i, 0, lo:hi, [lo, hi - 1]] = 220
        x[i, 0, [lo, hi - 1], lo:hi] = 220
    return x, y


def _params(**train: object) -> Params:
    return parse_params({"train": train})


@pytest.mark.parametrize(
    ("n", "batch"), [(30, 16), (862, 32), (1_078, 32), (1_195, 32), (5_000, 128), (55_000, 256)]
)
def test_batch_gives_about_32_steps_an_epoch(n: int, batch: int) -> None:
    got, reason = choose_batch(n)
    assert got == batch
    assert f"{n:,} train images" in reason


def test_epochs_fill_the_budget_within_the_caps() -> None:
    facts = Facts(1_000, 200, 10, 1, 32, 32, "cpu", "32-true")
    tp = _params(time_budget_min=1.0).train
    epochs, why = choose_epochs(tp, facts, 32, step_s=0.05)  # 32 steps: ~2.1 s an epoch
    assert 20 <= epochs <= 30 and "1 min budget" in why
    fast, why_fast = choose_epochs(tp, facts, 32, step_s=0.0001)
    assert fast == recipe.MAX_EPOCHS and "capped" in why_fast
    slow, why_slow = choose_epochs(tp, facts, 32, step_s=10.0)
    assert slow == 1 and "less than one epoch" in why_slow
    unbudgeted, why_none = choose_epochs(_params(time_budget_min=None).train, facts, 32, None)
    assert unbudgeted == -(-recipe.TARGET_STEPS // 32) and "no time budget" in why_none


@pytest.mark.parametrize(
    ("images", "value", "reason"),
    [(_arrows, "shift", "no flips"), (_rings, "flip", "horizontal flips")],
    ids=["mirror classes: off", "symmetric classes: on"],
)
def test_flips_off_for_mirror_classes_on_for_symmetric_ones(tmp_path, images, value, reason):
    card = _prepared(tmp_path / "d", *images(400), *images(100, seed=1))
    p = plan(_params(max_epochs=2).train, card, tmp_path / "d", "cpu", "32-true")
    aug = {c.key: c for c in p.choices}["augment"]
    assert aug.value == value and aug.by == "recipe" and reason in aug.reason


def test_every_auto_key_is_chosen_with_a_reason_and_the_users_keys_win(tmp_path: Path) -> None:
    x, y = _rings(300)
    card = _prepared(tmp_path / "d", x, y, *_rings(60, seed=1))
    p = plan(_params(time_budget_min=0.05).train, card, tmp_path / "d", "cpu", "32-true")
    by = {c.key: c for c in p.choices}
    assert set(by) == set(recipe.KEYS)
    assert all(c.by == "recipe" and c.reason for c in p.choices)
    assert p.train.arch == "cnn" and p.train.batch_size == 16  # 300 images
    assert isinstance(p.train.max_epochs, int) and "nominal" in by["max_epochs"].reason
    assert p.planned_epochs
    assert all(getattr(p.train, k) != "auto" for k in recipe.KEYS)

    mine = plan(
        _params(batch_size=64, max_epochs=7, augment="none", lr=0.01, arch="resnet").train,
        card,
        tmp_path / "d",
        "cpu",
        "32-true",
    )
    by = {c.key: c for c in mine.choices}
    assert (mine.train.batch_size, mine.train.max_epochs, mine.train.lr) == (64, 7, 0.01)
    assert mine.train.augment == "none" and mine.train.arch == "resnet"
    assert all(by[k].by == "params" for k in ("batch_size", "max_epochs", "augment", "lr", "arch"))
    assert by["early_stopping_patience"].by == "recipe"  # still auto: a fifth of 7, at least 3
    assert mine.train.early_stopping_patience == 3
    assert not mine.planned_epochs  # the user's epochs: no hard stop at the budget


def test_classic_recipe_is_the_old_fixed_defaults(tmp_path: Path) -> None:
    x, y = _rings(200)
    card = _prepared(tmp_path / "d", x, y, *_rings(40, seed=1))
    p = plan(_params(recipe="classic").train, card, tmp_path / "d", "cpu", "32-true")
    assert {k: getattr(p.train, k) for k in CLASSIC} == CLASSIC
    assert all(c.by == "classic" for c in p.choices)


def test_plan_is_saved_and_reloaded_for_a_resumed_run(tmp_path: Path) -> None:
    x, y = _rings(200)
    card = _prepared(tmp_path / "d", x, y, *_rings(40, seed=1))
    params = _params(time_budget_min=0.05)
    p = plan(params.train, card, tmp_path / "d", "cpu", "32-true")
    p.save(tmp_path / "recipe.json")
    again = load_plan(tmp_path / "recipe.json", params.train)
    assert again is not None and again.train == p.train and again.choices == p.choices
    (tmp_path / "bad.json").write_text("{not json")
    assert load_plan(tmp_path / "bad.json", params.train) is None
    assert load_plan(tmp_path / "missing.json", params.train) is None


def test_pretrained_weights_make_a_finetune_of_resnet18(tmp_path: Path) -> None:
    """A local state-dict file (as torchvision saves ImageNet weights): the recipe picks
    resnet18 and fine-tunes it; the body is frozen for the first epoch, then trains."""
    import lightning as L
    import torchvision
    from torch.utils.data import DataLoader

    from trainyard.model.classifier import Classifier
    from trainyard.training.builder import build_trainer
    from trainyard.training.datamodule import TensorBatches

    weights = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    x, y = _rings(64, size=32)
    card = _prepared(tmp_path / "d", x, y, *_rings(32, size=32, seed=1))
    p = plan(
        _params(pretrained=str(weights), max_epochs=2).train, card, tmp_path / "d", "cpu", "32-true"
    )
    by = {c.key: c for c in p.choices}
    assert p.finetune and p.train.arch == "resnet18" and str(weights) in by["arch"].reason
    assert p.train.lr == recipe.LR["finetune"] and p.train.pretrained == str(weights)

    L.seed_everything(0, verbose=False)
    model = Classifier(
        card=card.contract(), arch="resnet18", lr=p.train.lr, pretrained=str(weights), finetune=True
    )
    body_before = model.net.layer1[0].conv1.weight.detach().clone()
    head_before = model.net.fc.weight.detach().clone()
    loader = DataLoader(
        TensorBatches(torch.from_numpy(x), torch.from_numpy(y), 16, shuffle=True), batch_size=None
    )
    build_trainer(max_epochs=1, root=tmp_path).fit(model, loader)
    assert torch.equal(model.net.layer1[0].conv1.weight, body_before)  # frozen: epoch 1
    assert not torch.equal(model.net.fc.weight, head_before)  # the new head learns
    build_trainer(max_epochs=2, root=tmp_path).fit(model, loader)
    assert not torch.equal(model.net.layer1[0].conv1.weight, body_before)  # then all trains
    groups = model.optimizers().optimizer.param_groups
    assert len(groups) == 2 and groups[0]["initial_lr"] == pytest.approx(
        groups[1]["initial_lr"] / 10
    )


def test_probe_times_real_steps() -> None:
    facts = Facts(100, 20, 3, 1, 28, 28, "cpu", "32-true")
    assert 0 < speed.probe_step_s("cnn", facts, 16, "flip") < 5


# --- train.plan: fixed: the plan is a function of params, data and the kind of device ------


def _hog(seconds: float) -> list[subprocess.Popen]:
    """One busy-looping process per core: the machine a teammate runs a build on."""
    code = f"import time\nt = time.time() + {seconds}\nwhile time.time() < t: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]


def test_the_fixed_plan_is_the_same_on_a_busy_machine(tmp_path: Path) -> None:
    x, y = _rings(600)
    card = _prepared(tmp_path / "d", x, y, *_rings(100, seed=1))
    params = _params(time_budget_min=0.5)
    quiet = plan(params.train, card, tmp_path / "d", "cpu", "32-true")
    hogs = _hog(60)
    try:
        time.sleep(0.5)  # the hogs are running before the plan starts
        busy = plan(params.train, card, tmp_path / "d", "cpu", "32-true")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert busy.to_dict() == quiet.to_dict()
    epochs = {c.key: c for c in quiet.choices}["max_epochs"]
    assert epochs.by == "recipe" and "nominal for cnn on cpu, not timed" in epochs.reason
    # the nominal price is the counted FLOPs over the reference CPU's rate, no clock
    facts = Facts(600, 100, 2, 1, 16, 16, "cpu", "32-true")
    flops = speed.forward_flops("cnn", 1, 2, 16, 16)
    expected = speed.NOMINAL["cpu"]["step_s"] + 16 * flops / (speed.NOMINAL["cpu"]["cnn"] * 1e9)
    assert speed.nominal_step_s("cnn", facts, 16) == pytest.approx(expected)


def test_a_device_or_arch_without_a_nominal_speed_gets_the_step_budget() -> None:
    tp = _params().train
    gpu = Facts(50_000, 5_000, 10, 1, 28, 28, "gpu", "bf16-mixed", "Some Future GPU")
    step_s, priced = recipe.price_step(tp, "cnn", gpu, 1024, "flip")
    assert step_s is None and "no nominal speed of cnn on Some Future GPU" in priced
    epochs, why = recipe.choose_epochs(tp, gpu, 1024, step_s, priced)
    assert epochs == -(-recipe.TARGET_STEPS // -(-50_000 // 1024)) and "2,500" in why
    h200 = Facts(55_000, 5_000, 10, 1, 28, 28, "gpu", "bf16-mixed", "NVIDIA H200")
    assert recipe.price_step(tp, "cnn", h200, 4096, "flip")[0] is not None


def test_the_gpu_batch_is_measured_up_a_ladder_and_stable() -> None:
    def saturating(knee: int, noise: float = 0.0, seed: int = 0) -> speed.Measure:
        rng = np.random.default_rng(seed)

        def measure(batch: int) -> float:  # img/s rises until the GPU is full at `knee`
            return 400_000 * min(batch, knee) / knee * (1 + noise * rng.uniform(-1, 1))

        return measure

    # Fashion-MNIST's 55,000: the cap is 4,096 (8 steps an epoch at least)
    assert batch_rule.gpu_batch_cap(55_000) == 4096
    batch, why = batch_rule.choose_gpu_batch(55_000, saturating(2048))
    assert batch == 2048 and "4,096 gained +0%" in why and "256: " in why
    # run after run, with 5% timing noise, the same GPU takes the same batch
    picks = {batch_rule.choose_gpu_batch(55_000, saturating(2048, 0.05, s))[0] for s in range(20)}
    assert picks == {2048}
    # still paying at the data's cap: the cap
    assert batch_rule.choose_gpu_batch(55_000, saturating(1 << 20))[0] == 4096

    # out of memory at 2,048: the batch below it
    def oom(batch: int) -> float:
        if batch >= 2048:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return float(batch)

    batch, why = batch_rule.choose_gpu_batch(55_000, oom)
    assert batch == 1024 and "2,048 ran out of memory" in why
    # a small folder: the CPU rule's batch is the start, the data the cap
    assert batch_rule.choose_gpu_batch(700, saturating(1 << 20))[0] == 64


def test_a_gpu_plan_fills_the_gpu_and_scales_the_lr(tmp_path: Path) -> None:
    """The recipe given an H200's facts (no GPU here): the measured batch, the lr that
    follows it, epochs from the H200's nominal speed, compile only when it pays."""
    x, y = _rings(20_000, size=16)
    card = _prepared(tmp_path / "d", x, y, *_rings(500, size=16, seed=1))
    calls: list[int] = []

    def measure(batch: int) -> float:
        calls.append(batch)
        return 300_000 * min(batch, 1024) / 1024

    p = plan(_params().train, card, tmp_path / "d", "gpu", "bf16-mixed", "NVIDIA H200", measure)
    by = {c.key: c for c in p.choices}
    assert calls == [256, 512, 1024, 2048] and p.train.batch_size == 1024
    assert "the GPU's throughput" in by["batch_size"].reason
    assert p.train.lr == pytest.approx(recipe.LR["cnn"] * 2, rel=1e-3)  # sqrt(1024/256)
    assert "sqrt(1,024/256)" in by["lr"].reason
    assert "nominal for cnn on NVIDIA H200" in by["max_epochs"].reason
    assert p.train.compile is False and "would not pay" in by["compile"].reason
    long_run, why = recipe.choose_compile(
        Facts(1, 1, 2, 1, 8, 8, "gpu", "bf16-mixed", "NVIDIA H200"), 3600.0
    )
    assert long_run is True and "pays" in why
    cpu = plan(_params().train, card, tmp_path / "d", "cpu", "32-true")
    assert cpu.train.compile is False and cpu.train.batch_size == 256  # the CPU rule, unchanged
    assert cpu.train.lr == recipe.LR["cnn"]


def test_the_hard_stop_is_the_budget_only_for_a_timed_plan() -> None:
    assert time_limit_min(_params(plan="timed").train, planned_epochs=True) == 4 * HARD_STOP
    assert time_limit_min(_params(plan="timed").train, planned_epochs=False) is None
    assert time_limit_min(_params().train, planned_epochs=True) is None  # fixed: no stop
    assert time_limit_min(_params(time_limit_min=7).train, planned_epochs=False) == 7
    assert time_limit_min(_params(plan="timed", time_limit_min=None).train, True) is None


def test_a_fit_cut_by_the_time_limit_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real fit: the time limit stops it mid-plan, and stop_reason says so (train.json's
    stopped_by, the MLflow tag, a warning); a fit that runs its epochs says max_epochs."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import Callback

    from trainyard.model.classifier import Classifier
    from trainyard.training.builder import build_trainer, stop_reason
    from trainyard.training.datamodule import ImageDataModule

    rng = np.random.default_rng(0)
    arrays = {
        split: (rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, 2, n))
        for split, n in (("train", 64), ("val", 16), ("test", 16))
    }
    card = _card(2, 1, 8)

    class Slow(Callback):  # each step takes 0.2 s: a 1 s limit ends a 50-epoch plan early
        def on_train_batch_end(self, *args: object) -> None:
            time.sleep(0.2)

    def fit(max_epochs: int, max_time: timedelta | None, slow: bool) -> str:
        dm = ImageDataModule(arrays=arrays, card=card, batch_size=32, eval_batch_size=16)
        trainer = build_trainer(
            max_epochs=max_epochs,
            max_time=max_time,
            root=tmp_path,
            callbacks=[Slow()] if slow else [],
        )
        trainer.fit(Classifier(card=card.contract(), arch="cnn"), datamodule=dm)
        return stop_reason(trainer)

    with caplog.at_level("WARNING", logger="trainyard"):
        cut = fit(50, timedelta(seconds=1), slow=True)
    assert cut.startswith("time limit: train.time_limit_min (0.0167 min)") and "of the 50" in cut
    assert any("this model is not the plan's" in m for m in caplog.messages)
    assert fit(2, timedelta(minutes=5), slow=False) == "max_epochs"


def test_the_doctors_forecast_is_the_batch_the_plan_takes(tmp_path: Path) -> None:
    """forecast_batch (the doctor's batch line) agrees with plan(), on a CPU and given a
    GPU's facts and measurements; a batch set in params is named as such."""
    x, y = _rings(20_000, size=16)
    card = _prepared(tmp_path / "d", x, y, *_rings(500, size=16, seed=1))

    def measure(batch: int) -> float:
        return 300_000 * min(batch, 1024) / 1024

    for accelerator, device in (("cpu", "cpu"), ("gpu", "NVIDIA H200")):
        facts = Facts(20_000, 500, 2, 1, 16, 16, accelerator, "bf16-mixed", device)
        batch, by, why = recipe.forecast_batch(_params().train, facts, measure)
        p = plan(
            _params(max_epochs=2).train,
            card,
            tmp_path / "d",
            accelerator,
            "bf16-mixed",
            device,
            measure,
        )
        assert (batch, by) == (p.train.batch_size, "recipe")
        assert why.endswith({c.key: c for c in p.choices}["batch_size"].reason)
    gpu = Facts(20_000, 500, 2, 1, 16, 16, "gpu", "bf16-mixed", "NVIDIA H200")
    assert recipe.forecast_batch(_params(batch_size=96).train, gpu, measure)[:2] == (96, "params")
