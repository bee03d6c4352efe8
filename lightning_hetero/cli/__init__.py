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

Errors are one screen and name the fix (exit code 2, no usage dump; :mod:`lightning_hetero.cli.errors`): a strategy
name that is not registered lists ours and the closest match; every key of a config renamed in 0.2 in one message; a
``class_path`` whose module is not found names the working-directory rule; a strategy that cannot take the model
(GPT-2 under ``subspace_pipeline``) or the launch (a MatFormer tier list that fits neither the ranks nor the nodes) is
refused in the launching process, before any worker starts. ``--trainer.strategy.init_args.settings.<key>=<v>`` works
whether the YAML names the strategy by class or by its registered name (:mod:`lightning_hetero.cli.strategy_flags`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextvars import ContextVar
from typing import NoReturn

from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_hetero.callbacks  # noqa: F401  (short names for callbacks in YAML)
import lightning_hetero.data  # noqa: F401  (short names for data modules in YAML)
import lightning_hetero.models  # noqa: F401  (short names for modules in YAML)
from lightning_hetero.cli.errors import raised_by, renamed_settings_message, unimportable_class_message
from lightning_hetero.cli.spot_errors import fault_tolerance_message
from lightning_hetero.cli.strategy_flags import class_form, first_strategy_override, without_strategy_overrides
from lightning_hetero.models.base import HFModuleBase
from lightning_hetero.strategies.registry import import_cli_classes, unknown_strategy_message

# Short class names in YAML (``class_path: MatFormerStrategy``, ``class_path: TierEvaluation``): every strategy, its
# settings and its callbacks, from the one table.
import_cli_classes()

_ARGV: ContextVar[tuple[str, ...]] = ContextVar("lightning_hetero_cli_argv", default=())
"""The command line being parsed (a message about one renamed flag names the other renamed flags too)."""

# What a settings class' __post_init__ raises: "<Name>Settings.<field>=<value>: <fix>".
_SETTINGS_ERROR = re.compile(r"\b\w+Settings\.\w+=")


def explain(message: str) -> str:
    """The one-screen form of a parser error ``message``: what it is about and the fix, when we know better."""
    for better in (
        fault_tolerance_message(message),
        renamed_settings_message(message, _ARGV.get()),
        unimportable_class_message(message),
    ):
        if better is not None:
            return better
    return message


class HeteroArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one screen: the message (see :func:`explain`) and where help is."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print ``error: <message>`` and a one-line tip, exit with code 2 (no usage dump of every option)."""
        message = explain(message)
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)  # raised, not printed: jsonargparse is trying alternatives, or debugging
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "").replace("__main__.py", "python -m lightning_hetero")
        sys.stderr.write(f"error: {message}\n(`{prog} --help` lists every option)\n")
        sys.exit(2)


class HeteroCLI(LightningCLI):
    """LightningCLI whose bad configs are refused before any training, as one-screen errors (exit code 2).

    jsonargparse checks each settings field's type while parsing; the settings' own rules (ranges, fields that do
    not apply to a kind) run when the dataclass is built, in :meth:`instantiate_classes`, together with the
    strategy's launch check (world size, nodes) and, where a strategy declares one, its check of the model.
    """

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        given = list(sys.argv[1:] if args is None else args)
        token = _ARGV.set(tuple(given))
        try:
            named = _strategy_in_class_form(parser, given)
            if named is None:
                super().parse_arguments(parser, args)
            else:
                self.config = parser.parse_args(named)
        finally:
            _ARGV.reset(token)

    @override
    def before_instantiate_classes(self) -> None:
        strategy = self._get(self.config, "trainer", Namespace()).get("strategy")
        if isinstance(strategy, str):
            message = unknown_strategy_message(strategy, StrategyRegistry.available_strategies())
            if message is not None:
                self.parser.error(message)

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            if _SETTINGS_ERROR.search(str(error)):
                self.parser.error(_settings_error_lines(str(error)), error)
            if raised_by(error, "resolve_launch"):  # the strategy's launch check (world size, nodes)
                self.parser.error(f"trainer.strategy: {error}", error)
            raise
        try:
            check_model_fits_strategy(self.trainer, self.model)
        except ValueError as error:
            self.parser.error(f"trainer.strategy and model: {error}", error)


def _strategy_in_class_form(parser: LightningArgumentParser, args: list[str]) -> list[str] | None:
    """``args`` with the registered strategy name rewritten in class form before the first
    ``--trainer.strategy.<key>`` flag; None when there is no such flag or the strategy is given as a class."""
    first = first_strategy_override(args)
    if first is None:
        return None
    config = parser.parse_args(without_strategy_overrides(args))
    name = (config[config.subcommand] if config.get("subcommand") else config).get("trainer.strategy")
    if not isinstance(name, str) or "." in name or name != name.lower():
        return None  # a class: jsonargparse applies the flags to it (``--trainer.strategy=FlexDeMoStrategy``)
    message = unknown_strategy_message(name, StrategyRegistry.available_strategies())
    if message is not None:
        parser.error(message)
    form = class_form(name, StrategyRegistry)
    return None if form is None else [*args[:first], f"--trainer.strategy={json.dumps(form)}", *args[first:]]


def check_model_fits_strategy(trainer: Trainer, model: LightningModule | None) -> None:
    """Raise ``ValueError`` (naming the fix) if the strategy declares that it cannot train the model's HF family.

    Runs in the launching process on the model as the config builds it; a strategy opts in with a
    ``settings.check_model_types(model_types)`` method (e.g. ``SubspacePipelineSettings``). The workers check the
    built model again, so a model that names no family here (a user's, built later in ``configure_model``) passes.
    """
    check = getattr(getattr(trainer.strategy, "settings", None), "check_model_types", None)
    if callable(check) and model is not None:
        check(model_types(model))


def model_types(model: LightningModule) -> set[str]:
    """The HF ``model_type`` of the models ``model`` holds, or (not built yet) of the config our modules will build."""
    from transformers import PreTrainedModel

    built = {module.config.model_type for module in model.modules() if isinstance(module, PreTrainedModel)}
    if built or not isinstance(model, HFModuleBase) or model.hparams.get("pretrained") is not None:
        return built
    try:
        return {model.build_scratch_config({}).model_type}
    except Exception:  # noqa: BLE001  (an unknown preset: the module's own check reports it when it builds)
        return set()


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
