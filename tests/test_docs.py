"""The reference docs name every flag, variable and metric the code has, and links resolve.

Cheap checks that keep docs/configuration.md and docs/cli.md from drifting: a new flag or
environment variable without a line in the docs fails here.
"""

from __future__ import annotations

import argparse
import re

from coordinator_fixtures import REPO

DOCS = REPO / "docs"


def _options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """{subcommand: its long options} of a parser with subcommands."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {
                    s for a in sub._actions for s in a.option_strings if s.startswith("--")
                } - {"--help"}
    return out


def test_every_ckptd_serve_flag_is_in_configuration_md() -> None:
    from ckptd.cli import serve

    text = (DOCS / "configuration.md").read_text()
    for command, flags in _options(serve.build_parser()).items():
        assert f"ckptd {command}" in text, command
        missing = sorted(f for f in flags if f"`{f}" not in text)
        assert not missing, f"docs/configuration.md lacks ckptd {command} {missing}"


def test_every_ckptctl_command_and_flag_is_in_cli_md() -> None:
    from ckptd.cli import ckptctl

    text = (DOCS / "cli.md").read_text()
    for command, flags in _options(ckptctl.build_parser()).items():
        assert f"### {command}" in text, f"docs/cli.md has no section for ckptctl {command}"
        missing = sorted(f for f in flags if f not in text)
        assert not missing, f"docs/cli.md lacks ckptctl {command} {missing}"


def test_every_environment_variable_is_in_configuration_md() -> None:
    text = (DOCS / "configuration.md").read_text()
    pattern = re.compile(r"""(?:environ\.get|_env_int|_env_bool)\(\s*["']([A-Z0-9_]+)["']""")
    names = set()
    for py in [*(REPO / "ckptd").rglob("*.py"), *(REPO / "clients").rglob("*.py")]:
        names.update(pattern.findall(py.read_text()))
    names |= {"CKPT_CRASH_AT", "CKPT_PATH"}  # read through module constants
    assert len(names) > 15  # the pattern still finds them
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_every_metric_is_in_configuration_md() -> None:
    from ckptd.server.metrics import Metrics

    text = (DOCS / "configuration.md").read_text()
    names = {m.name for m in Metrics().registry.collect()}
    assert "ckptd_saves" in names
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"docs/configuration.md lacks metrics {missing}"


def test_relative_links_resolve() -> None:
    link = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")
    broken = []
    for md in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in link.findall(md.read_text()):
            path = (md.parent / target).resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(REPO)} -> {target}")
    assert not broken, broken
