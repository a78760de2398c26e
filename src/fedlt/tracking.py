"""Optional experiment tracking: TensorBoard event files beside the plain run files.

The run directory's own files (``metrics.jsonl``, ``summary.json``) are always written and are
the source of every table and plot; tracking only mirrors the evaluated rounds into
``RUN_DIR/tensorboard/`` for ``tensorboard --logdir runs/`` when ``run.tensorboard=true``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fedlt.config import Config
from fedlt.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"


def check_tracking(cfg: Config) -> None:
    """Fail before the run starts when tracking is enabled but its package is missing."""
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard=true needs the tensorboard package; "
                          "pip install 'fedlt[tracking]' (or tensorboard), or set run.tensorboard=false")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics line as flat tags: ``acc``, ``variants/ccvr/acc``, ``comm/up_model``."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round" or key == "per_class_acc":
            continue
        if isinstance(value, dict):
            for sub, v in scalars(value).items():
                out[f"{key}/{sub}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class Tracker:
    """Mirrors evaluated rounds into TensorBoard; a no-op when tracking is off."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.writer = None
        if cfg.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def log(self, row: dict[str, Any]) -> None:
        if self.writer is not None:
            for tag, value in scalars(row).items():
                self.writer.add_scalar(tag, value, global_step=row["round"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
