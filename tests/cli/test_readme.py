"""README starts with the two set-up commands, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    head = text.split("## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", head)


def test_readme_opens_with_exactly_two_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "scripts/setup.sh" in demo and "lightning-hetero fit --config configs/quickstart.yaml" in demo
    assert "scripts/setup.sh" in tests and "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    ci_lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines


def test_setup_installs_torch_before_the_package():
    setup = (REPO / "scripts/setup.sh").read_text()
    assert setup.index("torch==2.13.0") < setup.index("pip_install -e")
