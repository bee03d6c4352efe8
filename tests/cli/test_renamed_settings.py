"""Strategy settings through the CLI: YAML ``init_args.settings`` reaches the strategy, a bad value fails before
training naming the field, a key renamed in 0.2 fails naming its new place, and ``--help`` documents each field once.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lightning_hetero.cli import build_cli
from lightning_hetero.cli.errors import renamed_settings_message
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.replication import ReplicationSettings

YAML = """\
trainer:
  logger: false
  strategy:
    class_path: FlexDeMoStrategy
    init_args:
{init_args}
model:
  class_path: CausalLMModule
  init_args:
    preset: llama-tiny
"""


def _config(tmp_path: Path, init_args: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(YAML.format(init_args="\n".join(f"      {line}" for line in init_args.splitlines())))
    return str(path)


def test_yaml_settings_reach_the_strategy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    init_args = "settings:\n  shard_size: 1\n  drift_check_every: 5\n  replication: {kind: topk, chunk: 16}"
    cli = build_cli(
        ["--config", _config(tmp_path, init_args), "--trainer.strategy.init_args.settings.replication.values=sign"],
        run=False,
    )
    settings = cli.trainer.strategy.settings
    assert isinstance(settings, FlexDeMoSettings)
    assert (settings.shard_size, settings.drift_check_every) == (1, 5)
    assert settings.replication == ReplicationSettings(kind="topk", chunk=16, values="sign")
    assert cli.trainer.strategy.runtime.make_replicator().name == "topk"


@pytest.mark.parametrize(
    ("init_args", "named"),
    [
        ("settings: {shard_size: 0}", "FlexDeMoSettings.shard_size=0"),
        ("settings: {replication: {kept_fraction: 2.0}}", "ReplicationSettings.kept_fraction=2.0"),
        ("settings: {replication: {sync_every: 4}}", "ReplicationSettings.sync_every=4"),  # not with demo
    ],
)
def test_invalid_setting_fails_at_parse_time_naming_the_field(tmp_path, monkeypatch, capsys, init_args, named):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        build_cli(["--config", _config(tmp_path, init_args)], run=False)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("how", "old", "new"),
    [
        ("yaml", "compression: 0.03", "'compression' -> 'settings.replication.kept_fraction'"),
        ("yaml", "shard_size: 2", "'shard_size' -> 'settings.shard_size'"),
        ("yaml", "replicator_options: {values: sign}", "'replicator_options' -> 'settings.replication"),
        ("flag", "--trainer.strategy.init_args.compression=0.03", "-> 'settings.replication.kept_fraction'"),
        ("flag", "--trainer.strategy.init_args.replicator=demo", "'replicator' -> 'settings.replication.kind'"),
        ("flag", "--trainer.strategy.init_args.settings.compression=0.03", "-> 'settings.replication.kept_fraction'"),
    ],
)
def test_renamed_key_fails_naming_the_new_key(tmp_path, monkeypatch, capsys, how, old, new):
    monkeypatch.chdir(tmp_path)
    if how == "yaml":
        args = ["--config", _config(tmp_path, old)]
    else:
        args = ["--config", _config(tmp_path, "settings: {}"), old]
    with pytest.raises(SystemExit):
        build_cli(args, run=False)
    err = capsys.readouterr().err
    assert "FlexDeMoStrategy:" in err and "renamed in 0.2" in err and new in err
    assert "is not accepted" not in err  # jsonargparse's generic message is replaced


def test_other_errors_keep_jsonargparse_message():
    assert (
        renamed_settings_message("Problem with given class_path 'x.Y':\n  Option 'compression' is not accepted") is None
    )
    message = "Problem with given class_path 'lightning_hetero.FlexDeMoStrategy':\n  Option 'bogus' is not accepted"
    assert renamed_settings_message(message) is None
    # a strategy without settings_class (not converted, or a user's) is skipped
    message = "class_path 'lightning.pytorch.strategies.DDPStrategy':\n  Option 'shard_size' is not accepted"
    assert renamed_settings_message(message) is None


def _attributes(cls: type) -> dict[str, str]:
    """Field -> the first words of its doc in the class docstring's ``Attributes:`` section."""
    section = (cls.__doc__ or "").split("Attributes:")[1]
    return {m[1]: " ".join(m[2].split()[:5]) for m in re.finditer(r"^        (\w+): (.+)$", section, re.M)}


def test_strategy_help_documents_each_settings_field_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        build_cli(["fit", "--trainer.strategy.help", "FlexDeMoStrategy"], run=False)
    out = " ".join(capsys.readouterr().out.split())
    options = {f"settings.{name}": doc for name, doc in _attributes(FlexDeMoSettings).items() if name != "replication"}
    options |= {f"settings.replication.{name}": doc for name, doc in _attributes(ReplicationSettings).items()}
    expected = {f"settings.{f.name}" for f in dataclasses.fields(FlexDeMoSettings) if f.name != "replication"}
    expected |= {f"settings.replication.{f.name}" for f in dataclasses.fields(ReplicationSettings)}
    assert set(options) == expected  # every field is documented in Attributes
    for option, doc in options.items():
        entries = re.findall(rf"(?<!\[)--trainer\.strategy\.{re.escape(option)} \S+ (.{{{len(doc)}}})", out)
        assert entries == [doc], (option, entries)  # listed once (besides the usage line), with its doc
