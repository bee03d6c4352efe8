"""The ``lightning-hetero`` command: LightningCLI with our modules, data and strategies pre-registered.

``lightning-hetero fit --config configs/quickstart.yaml`` (or ``python -m lightning_hetero fit ...``) is
``LightningCLI`` in subclass mode: the YAML picks any ``LightningModule`` / ``LightningDataModule`` by ``class_path``
(ours resolve by short name too, e.g. ``class_path: CausalLMModule``; strategies likewise,
``class_path: MatFormerStrategy`` with ``init_args``), and ``trainer.strategy`` may be one of our
registered names because importing :mod:`lightning_hetero` registers them before the Trainer is built.

It takes a user's code as a stock ``LightningCLI`` script does: ``data`` is optional (a module with its own
``train_dataloader`` needs none), and ``class_path: mynets.MyModel`` is imported from the current directory, as
``python script.py`` / ``python -m`` would, without ``PYTHONPATH=.``.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_hetero  # noqa: F401  (registers strategy names)
import lightning_hetero.callbacks  # noqa: F401  (short names for callbacks in YAML)
import lightning_hetero.data  # noqa: F401  (short names for data modules in YAML)
import lightning_hetero.models  # noqa: F401  (short names for modules in YAML)
from lightning_hetero import (  # noqa: F401  (short class names for strategies: ``class_path: MatFormerStrategy``)
    FlexDeMoStrategy,
    LayerwiseStrategy,
    MatFormerStrategy,
    SparseFlipStrategy,
    SubspacePipelineStrategy,
)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the CLI.

    ``data`` is optional, as in a stock ``LightningCLI(MyModel)`` script: without it the module's own dataloaders are
    used and ``cli.datamodule`` is None; with it, any ``LightningDataModule`` (ours by short name) is selectable.

    Args:
        args: Command-line arguments (a list like ``["fit", "--config", "x.yaml"]``), a dict, or None for ``sys.argv``.
        run: If False, only parse and instantiate (``cli.trainer``, ``cli.model``, ``cli.datamodule``).
    """
    return LightningCLI(
        LightningModule,
        None,  # as with no DataModule class: ``data`` is not required, and any LightningDataModule subclass is allowed
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True},
        seed_everything_default=42,
        args=args,
        run=run,
    )


def put_working_directory_on_path() -> None:
    """Put the current directory first on ``sys.path`` (once), so that ``class_path: mynets.X`` finds ``mynets.py``.

    The console script lives in ``bin/``, so Python puts that directory on ``sys.path``, not the user's; a stock
    ``python script.py`` or ``python -m`` run has the user's directory there. Ranks that Lightning starts for
    ``devices > 1`` re-run the same command in the same directory, so they find the module too.
    """
    cwd = os.getcwd()
    if any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        return
    sys.path.insert(0, cwd)


def main(args: ArgsType = None) -> None:
    """Console-script entry point (``lightning-hetero``, ``python -m lightning_hetero``)."""
    put_working_directory_on_path()
    build_cli(args)


if __name__ == "__main__":
    main()
