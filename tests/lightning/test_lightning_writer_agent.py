"""``writer="process"`` under a real ``Trainer`` SIGKILLed right after a save returned (issue 21).

The child (``_child_writer_agent.py``) trains with ``ModelCheckpoint`` saving every step and
kills itself the moment its N-th save returns, while the agent is still writing. Every save
that returned must be committed and verify, hold the weights and the step the trainer had,
``latest()`` must be the newest of them, the agent must exit on its own leaving only the newest
file's snapshot in shared memory, and a new ``Trainer`` must resume from that newest checkpoint.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from agentwatch import assert_only_snapshot_of, exited
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_helpers import (
    HERE,
    StepBatches,
    TinyModel,
    assert_bitwise_equal,
    make_trainer,
    run_python,
    weights,
)
from stagesave.lightning import StagedCheckpointIO

import stagesave

CHILD = HERE / "_child_writer_agent.py"
MARKER = 1 << 21  # the child's marker tensor: this many float32 elements, filled with the step


class Probe(Callback):
    """What the resumed run starts from: the step and the weights after the restore."""

    step = -1
    weights: dict[str, torch.Tensor]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = trainer.global_step
        self.weights = weights(pl_module)


@pytest.mark.parametrize(
    ("kill_after", "choice"), [(1, "argument"), (3, "environment"), (6, "argument")]
)
def test_trainer_sigkilled_after_a_save_returned_every_returned_save_is_committed(
    tmp_path: Path, shm: Path, kill_after: int, choice: str
) -> None:
    root = tmp_path / "run"
    env = {"STAGESAVE_SHM_DIR": str(shm), "OMP_NUM_THREADS": "1"}
    if choice == "environment":  # the plugin leaves writer unset; $STAGESAVE_WRITER chooses
        env["STAGESAVE_WRITER"] = "process"
    proc = run_python([str(CHILD), str(root), str(kill_after)], env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert "fit returned" not in out
    saved = [line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("SAVED ")]
    steps = [int(s[1]) for s in saved]
    assert steps == list(range(1, kill_after + 1)), out[-3000:]
    agents = {s[2] for s in saved}
    assert len(agents) == 1 and agents != {"None"}, agents  # one agent served the whole run
    agent = int(agents.pop())
    paths = [s[3] for s in saved]
    ckpt_dir = root / "ckpt"
    assert paths == [str(ckpt_dir / f"epoch=0-step={s}.ckpt") for s in steps]

    assert exited(agent), f"the writer agent {agent} did not exit after its trainer died"
    # nothing but the newest file's snapshot is left in shared memory (checked before any load,
    # which may consume it)
    assert_only_snapshot_of(shm, paths[-1])

    # exactly the checkpoints whose save returned, and no temporary beside them
    assert sorted(p.name for p in ckpt_dir.iterdir()) == sorted(Path(p).name for p in paths)
    with stagesave.Checkpointer() as ck:
        for path in paths:
            info = ck.verify(path)
            assert info.status == "verified", (path, info.status, info.problems)
        best = ck.latest(ckpt_dir)
        assert best is not None and best.path == paths[-1]
        for step, path in zip(steps, paths):  # the newest last: its load may use the snapshot
            loaded = ck.load(path, verify=True)
            assert loaded["global_step"] == step
            assert torch.equal(loaded["marker"], torch.full((MARKER,), float(step)))
            expected = torch.load(root / "expected" / f"step={step}.pt", weights_only=True)
            assert_bitwise_equal(loaded["state_dict"], expected)

    # a new Trainer resumes from the newest checkpoint: its step and its weights
    probe = Probe()
    trainer = make_trainer(tmp_path / "resumed", [StagedCheckpointIO()], [probe],
                           max_steps=kill_after + 1, enable_checkpointing=False)
    trainer.fit(TinyModel(), StepBatches(n=50), ckpt_path=best.path)
    assert probe.step == kill_after
    expected = torch.load(root / "expected" / f"step={kill_after}.pt", weights_only=True)
    assert_bitwise_equal(probe.weights, expected)
    assert trainer.global_step == kill_after + 1
