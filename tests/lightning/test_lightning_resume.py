"""Resuming: bitwise the same weights as an uninterrupted run; ``latest()`` skips torn and
corrupt checkpoints; the files stay plain Lightning checkpoints, readable without stagesave."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, assert_bitwise_equal, make_trainer, weights
from stagesave.lightning import StagedCheckpointIO, latest

import stagesave


def _fit(tmp_path: Path, max_steps: int, ckpt_path: str | None = None, every: int = 3) -> TinyModel:
    seed_everything(7, workers=True)
    model = TinyModel()
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()], [mc], max_steps=max_steps, max_epochs=-1
    )
    trainer.fit(model, StepBatches(n=5), ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return model


def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = weights(_fit(tmp_path / "straight", 13))
    _fit(tmp_path / "broken", 7)  # "crashes" after step 7; newest checkpoint: step 6 (mid-epoch)
    resume = latest(tmp_path / "broken" / "ckpt")
    assert resume is not None and resume.endswith("epoch=1-step=6.ckpt")
    resumed = weights(_fit(tmp_path / "broken", 13, ckpt_path=resume))
    assert_bitwise_equal(resumed, reference)


def _three_checkpoints(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    io = StagedCheckpointIO()
    for step in (1, 2, 3):
        io.save_checkpoint(
            {"w": torch.full((1024,), float(step)), "global_step": step}, d / f"step={step}.ckpt"
        )
        io.wait()
    io.teardown()
    return d


def test_latest_skips_a_truncated_checkpoint(tmp_path: Path) -> None:
    d = _three_checkpoints(tmp_path)
    newest = d / "step=3.ckpt"
    newest.write_bytes(newest.read_bytes()[:-100])
    with pytest.warns(UserWarning, match=r"step=3\.ckpt"):
        assert latest(d) == str(d / "step=2.ckpt")


def test_latest_verifies_by_default_and_skips_a_corrupted_checkpoint(tmp_path: Path) -> None:
    d = _three_checkpoints(tmp_path)
    newest = d / "step=3.ckpt"
    data = bytearray(newest.read_bytes())
    i = data.find(torch.full((1,), 3.0).numpy().tobytes())
    data[i] ^= 0xFF  # one flipped bit inside the tensor bytes: size and id unchanged
    newest.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # without verify only sizes and ids are checked
        assert latest(d, verify=False) == str(newest)
    with pytest.warns(UserWarning, match=r"step=3\.ckpt.*checksum mismatch"):
        assert latest(d) == str(d / "step=2.ckpt")
    io = StagedCheckpointIO()
    with pytest.warns(UserWarning, match=r"step=3\.ckpt.*checksum mismatch"):
        assert io.latest(d) == str(d / "step=2.ckpt")  # the plugin's own latest() verifies too
    io.teardown()
    with pytest.raises(stagesave.IntegrityError, match="corrupt"):
        StagedCheckpointIO().load_checkpoint(newest)


def test_latest_skips_a_checkpoint_torn_by_a_crash(tmp_path: Path) -> None:
    d = _three_checkpoints(tmp_path)
    # A crash after the proof but before the publish leaves a complete, self-proving file (with
    # the highest sequence number of the directory) under its hidden temporary name only; a
    # crash mid-data leaves a partial temporary.
    io = StagedCheckpointIO()
    io.save_checkpoint({"w": torch.full((1024,), 4.0), "global_step": 4}, d / "step=4.ckpt")
    io.teardown()
    assert stagesave.latest(d).seq == 4  # type: ignore[union-attr]
    (d / "step=4.ckpt").rename(d / f".step=4.ckpt.123-abcd1234{stagesave.TMP_MARKER}")
    (d / f".step=5.ckpt.123-abcd5678{stagesave.TMP_MARKER}").write_bytes(b"partial")
    assert latest(d) == str(d / "step=3.ckpt")
    assert latest(d, verify=True) == str(d / "step=3.ckpt")


def test_latest_of_an_empty_or_missing_directory_is_none(tmp_path: Path) -> None:
    assert latest(tmp_path / "nothing-yet") is None
    (tmp_path / "empty").mkdir()
    assert latest(tmp_path / "empty") is None


def test_plain_lightning_checkpoints_resume_through_the_plugin(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    make_trainer(tmp_path, [], [ModelCheckpoint(dirpath=d)], max_steps=3).fit(
        TinyModel(), StepBatches()
    )
    found = latest(d)  # no proof: listed as an unverified, still valid, checkpoint
    assert found == str(d / "epoch=0-step=3.ckpt")
    trainer = make_trainer(tmp_path, [StagedCheckpointIO()], max_steps=5)
    trainer.fit(TinyModel(), StepBatches(), ckpt_path=found)
    assert trainer.global_step == 5


def test_plugin_checkpoints_are_plain_lightning_checkpoints(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    model = TinyModel()
    make_trainer(tmp_path, [StagedCheckpointIO()], [ModelCheckpoint(dirpath=d)], max_steps=3).fit(
        model, StepBatches()
    )
    path = d / "epoch=0-step=3.ckpt"
    raw = torch.load(path, weights_only=True)
    assert raw["global_step"] == 3 and "optimizer_states" in raw
    assert_bitwise_equal(raw["state_dict"], weights(model))
    loaded = TinyModel.load_from_checkpoint(path)
    assert_bitwise_equal(weights(loaded), weights(model))
    trainer = make_trainer(tmp_path, [], max_steps=4)  # Lightning's default TorchCheckpointIO
    trainer.fit(TinyModel(), StepBatches(), ckpt_path=path)
    assert trainer.global_step == 4


def test_ckpt_path_last_resumes_with_the_plugin(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_last=True)
    make_trainer(tmp_path, [StagedCheckpointIO()], [mc], max_steps=4).fit(
        TinyModel(), StepBatches()
    )
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()], [ModelCheckpoint(dirpath=d, save_last=True)], max_steps=6
    )
    trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")
    assert trainer.global_step == 6


def _flip_tensor_byte(path: Path) -> None:
    """Flip one byte inside the first tensor record (size, names and proof unchanged)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        record = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0)
    data = bytearray(path.read_bytes())
    name_len, extra_len = (
        int.from_bytes(data[record.header_offset + 26 : record.header_offset + 28], "little"),
        int.from_bytes(data[record.header_offset + 28 : record.header_offset + 30], "little"),
    )
    data[record.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(data))


class _StartStep(ModelCheckpoint.__mro__[1]):  # lightning Callback
    def __init__(self) -> None:
        self.start: int | None = None

    def on_train_start(self, trainer: object, pl_module: object) -> None:
        self.start = trainer.global_step  # type: ignore[attr-defined]


def _last_run(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1, save_last=True)
    make_trainer(tmp_path, [StagedCheckpointIO()], [mc], max_steps=4).fit(
        TinyModel(), StepBatches()
    )
    assert sorted(p.name for p in d.iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "last.ckpt",
    ]
    return d


def test_ckpt_path_last_that_is_damaged_resumes_from_the_newest_intact_checkpoint(
    tmp_path: Path,
) -> None:
    d = _last_run(tmp_path)
    _flip_tensor_byte(d / "last.ckpt")
    start = _StartStep()
    trainer = make_trainer(
        tmp_path,
        [StagedCheckpointIO()],
        [ModelCheckpoint(dirpath=d, save_last=True), start],
        max_steps=6,
    )
    with pytest.warns(UserWarning) as record:
        trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")
    messages = [str(w.message) for w in record]
    assert any("last.ckpt" in m and "checksum mismatch" in m for m in messages), messages
    assert any(
        f"resuming from {d / 'epoch=0-step=4.ckpt'} instead of {d / 'last.ckpt'}" in m
        for m in messages
    )
    assert start.start == 4 and trainer.global_step == 6


def test_ckpt_path_last_that_is_intact_is_lightnings_choice_without_a_warning(
    tmp_path: Path,
) -> None:
    d = _last_run(tmp_path)
    start = _StartStep()
    trainer = make_trainer(
        tmp_path,
        [StagedCheckpointIO()],
        [ModelCheckpoint(dirpath=d, save_last=True), start],
        max_steps=6,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*(skipping checkpoint|resuming from .* instead of)"
        )
        trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")
    assert start.start == 4 and trainer.global_step == 6


def test_ckpt_path_last_with_nothing_intact_raises_the_integrity_error(tmp_path: Path) -> None:
    d = _last_run(tmp_path)
    for p in d.iterdir():
        _flip_tensor_byte(p)
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()], [ModelCheckpoint(dirpath=d, save_last=True)], max_steps=6
    )
    with (
        pytest.warns(UserWarning, match="skipping checkpoint"),
        pytest.raises(stagesave.IntegrityError, match=r"last.ckpt"),
    ):
        trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")


def test_ckpt_path_last_without_the_plugin_is_untouched(tmp_path: Path) -> None:
    d = _last_run(tmp_path)
    _flip_tensor_byte(d / "last.ckpt")
    start = _StartStep()
    trainer = make_trainer(
        tmp_path, [], [ModelCheckpoint(dirpath=d, save_last=True), start], max_steps=6
    )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*(skipping checkpoint|resuming from .* instead of)"
        )
        # torch.load does not check CRC-32s
        trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")
    assert start.start == 4


def test_a_resumed_fit_makes_its_first_saves_buffer_once_the_loaded_checkpoint_is_freed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fit(ckpt_path=file)``: after ``resume_end`` freed the loaded checkpoint (not while
    Lightning still holds it), the staging buffer of the fit's first save is made (the file's
    size) and that save leases it; ``validate(ckpt_path=...)``, a fit whose checkpoints are
    weights only and a fit without checkpointing make none; teardown leaves no thread."""
    import threading

    from lightning.pytorch.callbacks import Callback

    from stagesave.saving.buffers import GROWTH_STEP, HostBuffer

    made: list[tuple[int, str]] = []  # staging buffers (a load's image is not one)
    prepared: list[tuple[int, object]] = []  # (bytes, what the connector still held)
    real_allocate = HostBuffer.allocate.__func__  # type: ignore[attr-defined]
    real_prepare = stagesave.Checkpointer.prepare_buffer
    trainers: list[object] = []

    def allocate(cls: type, capacity: int, pinned: bool, shared: bool = False) -> HostBuffer:
        if capacity % GROWTH_STEP == 0:  # staging buffers grow in these steps
            made.append((capacity, threading.current_thread().name))
        return real_allocate(cls, capacity, pinned, shared)  # type: ignore[no-any-return]

    def prepare(self: stagesave.Checkpointer, nbytes: int) -> None:
        held = trainers[-1]._checkpoint_connector._loaded_checkpoint  # type: ignore[attr-defined]
        prepared.append((nbytes, held))
        real_prepare(self, nbytes)

    d = tmp_path / "ckpt"
    make_trainer(tmp_path, [StagedCheckpointIO()],
                 [ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1)],
                 max_steps=2).fit(TinyModel(), StepBatches())
    first = d / "epoch=0-step=2.ckpt"
    size = first.stat().st_size
    monkeypatch.setattr(HostBuffer, "allocate", classmethod(allocate))
    monkeypatch.setattr(stagesave.Checkpointer, "prepare_buffer", prepare)
    before = set(threading.enumerate())

    def run(callbacks: list[Callback], fn: str = "fit", **kw: object) -> object:
        trainer = make_trainer(tmp_path, [StagedCheckpointIO(prepare_buffer=True)], callbacks,
                               max_steps=4, **kw)
        trainers.append(trainer)
        getattr(trainer, fn)(TinyModel(), StepBatches(), ckpt_path=str(first))
        return trainer

    run([], "validate")
    run([ModelCheckpoint(dirpath=tmp_path / "w", every_n_train_steps=2, save_weights_only=True)])
    run([], enable_checkpointing=False)
    assert prepared == []
    made.clear()

    saved: list[int] = []

    class _Count(Callback):
        def on_save_checkpoint(self, *args: object) -> None:
            saved.append(len(made))  # buffers made when the first save began

    trainer = run([ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1), _Count()])
    assert trainer.global_step == 4  # type: ignore[attr-defined]
    assert prepared == [(size, {})]  # made once Lightning let go of the loaded checkpoint
    assert len(made) == 1 and made[0][1] == "stagesave-buffer"  # made ahead, then leased
    assert saved and saved[0] == 1  # already made when the fit's first save began
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("stagesave") and t not in before] == []
    got = torch.load(d / "epoch=0-step=4.ckpt", weights_only=False)
    assert got["global_step"] == 4
