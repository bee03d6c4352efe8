"""The ``lightning-hetero`` command: LightningCLI with our modules, data and strategies pre-registered.

``lightning-hetero fit --config configs/quickstart.yaml`` (or ``python -m lightning_hetero fit ...``) is
``LightningCLI`` in subclass mode: the YAML picks any ``LightningModule`` / ``LightningDataModule`` by ``class_path``
(ours resolve by short name too, e.g. ``class_path: CausalLMModule``; strategies likewise,
``class_path: MatFormerStrategy`` with ``init_args``), and ``trainer.strategy`` may be one of our
registered names because importing :mod:`lightning_hetero` registers them before the Trainer is built.

It takes a user's code as a stock ``LightningCLI`` script does: ``data`` is optional (a module with its own
``train_dataloader`` needs none), and ``class_path: mynets.MyModel`` is imported from the current directory, as
``python script.py`` / ``python -m`` would, without ``PYTHONPATH=.``.

Strategy settings live in one typed object per strategy, ``init_args: {settings: {...}}`` (e.g.
``--trainer.strategy.init_args.settings.shard_size=2``); jsonargparse validates them and ``--trainer.strategy.help
FlexDeMoStrategy`` lists every field with its doc. A key renamed in 0.2 (``init_args: {compression: 0.03}``) fails
with a message naming where it went (the strategy class' ``settings_class.RENAMED``), not a generic "not accepted".
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_hetero  # noqa: F401  (registers strategy names)
import lightning_hetero.callbacks  # noqa: F401  (short names for callbacks in YAML)
import lightning_hetero.data  # noqa: F401  (short names for data modules in YAML)
import lightning_hetero.models  # noqa: F401  (short names for modules in YAML)

# Short class names: strategies (``class_path: MatFormerStrategy``) and their typed settings
# (``lightning_hetero.cli.FlexDeMoSettings``; YAML needs no class_path for ``init_args: {settings: {...}}``).
from lightning_hetero import (  # noqa: F401
    FlexDeMoSettings,
    FlexDeMoStrategy,
    LayerwiseSettings,
    LayerwiseStrategy,
    MatFormerSettings,
    MatFormerStrategy,
    ReplicationSettings,
    SparseFlipSettings,
    SparseFlipStrategy,
    SubspacePipelineSettings,
    SubspacePipelineStrategy,
)
from lightning_hetero.core.settings import RenamedSettingError, reject_renamed

# jsonargparse's message for a key a class does not take, under the class it was given to (one key per message).
_NOT_ACCEPTED = re.compile(
    r"class_path '(?P<path>[\w.]+)'(?:(?!class_path ').)*?"
    r"(?:Option '(?P<key>[\w.]+)' is not accepted|unrecognized arguments: --(?P<arg>[\w.]+))",
    re.S,
)


def renamed_setting_message(message: str) -> str | None:
    """The renamed-key explanation for a jsonargparse error ``message``, or None when it is about something else.

    A strategy class with a ``settings_class`` declares its renamed keys in ``settings_class.RENAMED``; strategies
    without one (not converted yet, or a user's) are skipped.
    """
    for match in _NOT_ACCEPTED.finditer(message):
        cls = _import_class_path(match["path"])
        renamed = getattr(getattr(cls, "settings_class", None), "RENAMED", None)
        if cls is None or not isinstance(renamed, dict):
            continue
        # A dotted key (``replicator_options.values``, ``settings.compression``): its first renamed part.
        parts = (match["key"] or match["arg"]).split(".")
        try:
            reject_renamed(cls.__name__, parts, renamed)
        except RenamedSettingError as error:
            return str(error)
    return None


def _import_class_path(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001  (an unimportable class_path: jsonargparse's own message stands)
        return None


class HeteroArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors about a renamed strategy setting name the new key."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Report ``message``; one about a key renamed in 0.2 is replaced by where the key went."""
        renamed = renamed_setting_message(message)
        if renamed is not None:
            message = renamed
        super().error(message, ex)


# What a settings class' __post_init__ raises: "<Name>Settings.<field>=<value>: <fix>".
_SETTINGS_ERROR = re.compile(r"\b\w+Settings\.\w+=")


class HeteroCLI(LightningCLI):
    """LightningCLI whose invalid strategy settings are reported like any other bad argument (usage, exit code 2).

    jsonargparse checks each settings field's type while parsing; the settings' own rules (ranges, fields that do
    not apply to a kind) run when the dataclass is built, in :meth:`instantiate_classes`: before any training.
    """

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            if not _SETTINGS_ERROR.search(str(error)):
                raise
            self.parser.error(_settings_error_lines(str(error)), error)


def _settings_error_lines(message: str) -> str:
    """The lines of a jsonargparse union error that name a settings field (all of it when none does)."""
    lines = [line.strip(" -") for line in message.splitlines() if _SETTINGS_ERROR.search(line)]
    return "\n".join(lines) if lines else message


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the CLI.

    ``data`` is optional, as in a stock ``LightningCLI(MyModel)`` script: without it the module's own dataloaders are
    used and ``cli.datamodule`` is None; with it, any ``LightningDataModule`` (ours by short name) is selectable.

    Args:
        args: Command-line arguments (a list like ``["fit", "--config", "x.yaml"]``), a dict, or None for ``sys.argv``.
        run: If False, only parse and instantiate (``cli.trainer``, ``cli.model``, ``cli.datamodule``).
    """
    return HeteroCLI(
        LightningModule,
        None,  # as with no DataModule class: ``data`` is not required, and any LightningDataModule subclass is allowed
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True},
        parser_class=HeteroArgumentParser,
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
