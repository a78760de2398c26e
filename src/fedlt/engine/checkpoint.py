"""Resumable checkpoints: server state, per-client state and the engine's counters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fedlt.errors import FedltError

CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / (CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run_dir / CHECKPOINT_FILE)


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        raise FedltError(f"{run_dir} has no {CHECKPOINT_FILE}; resume a run directory that saved a checkpoint "
                         "(run.checkpoint_every > 0)")
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # a truncated or foreign file: tell the user which one
        raise FedltError(f"{path} is not a readable fedlt checkpoint ({type(err).__name__}); "
                         "delete it and start the run again") from None
