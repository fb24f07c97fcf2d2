"""Checkpoints load with weights_only: tensors and plain containers come back; pickled objects are refused."""

import os
import pickle

import pytest
import torch

from rollart.training.checkpoint_io import (
    UnsafeCheckpointError,
    load_checkpoint_file,
    save_checkpoint_file,
)


class _Payload:
    """Unpickling this runs ``os.system``: what a tampered checkpoint would carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_round_trips_tensors_optimiser_state_and_plain_extra(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    extra = {
        "step": 3,
        "scheduler": {"next_round": [2, 1], "retry": {0: [1]}, "counts": {"a": 1}},
        "consumed": ["0:0:0:v0"],
    }
    path = save_checkpoint_file(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "version": 1,
            "extra": extra,
        },
        tmp_path / "c.pt",
    )
    state = load_checkpoint_file(path)
    assert torch.equal(state["model"]["weight"], model.state_dict()["weight"])
    assert state["extra"] == extra and state["version"] == 1
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])


def test_a_checkpoint_with_a_pickled_object_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "version": 0, "extra": {"x": _Payload(str(marker))}}, path)
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        load_checkpoint_file(path)
    assert not marker.exists()
    with open(tmp_path / "raw.pt", "wb") as f:  # a plain pickle, not even torch's format
        pickle.dump(_Payload(str(marker)), f)
    with pytest.raises((UnsafeCheckpointError, RuntimeError)):
        load_checkpoint_file(tmp_path / "raw.pt")
    assert not marker.exists()
