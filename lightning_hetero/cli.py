"""The ``lightning-hetero`` command: LightningCLI with our modules, data and strategies pre-registered.

``lightning-hetero fit --config configs/quickstart.yaml`` is ``LightningCLI`` in subclass mode: the YAML picks any
``LightningModule`` / ``LightningDataModule`` by ``class_path`` (ours resolve by short name too, e.g.
``class_path: CausalLMModule``), and ``trainer.strategy`` may be one of our registered names because importing
:mod:`lightning_hetero` registers them before the Trainer is built.
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_hetero  # noqa: F401  (registers strategy names)
import lightning_hetero.callbacks  # noqa: F401  (short names for callbacks in YAML)
import lightning_hetero.data  # noqa: F401  (short names for data modules in YAML)
import lightning_hetero.models  # noqa: F401  (short names for modules in YAML)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the CLI.

    Args:
        args: Command-line arguments (a list like ``["fit", "--config", "x.yaml"]``), a dict, or None for ``sys.argv``.
        run: If False, only parse and instantiate (``cli.trainer``, ``cli.model``, ``cli.datamodule``).
    """
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True},
        seed_everything_default=42,
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Console-script entry point (``lightning-hetero``)."""
    build_cli(args)


if __name__ == "__main__":
    main()
