"""User-facing help and reference: the strategies' help on the command line, every config field in the
configuration reference, and every decision the code links to written down in docs/decisions.md."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from xc_dagster.cli import main as cli_main
from xc_dagster.config import STAGES
from xc_dagster.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent


def test_strategies_command_lists_them_and_shows_one_with_its_settings(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    assert cli_main(["strategies"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(STRATEGIES)
    assert cli_main(["strategies", "mips"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mips: MIPS-s")
    assert "  classifier.negatives = mips\n" in out and "  index.sources = W,label,knn\n" in out
    settings = out.split("Settings on top of the preset:\n")[1].splitlines()
    assert len(settings) == len(STRATEGIES["mips"].overrides) and all(" = " in line for line in settings)


def test_every_config_field_is_in_the_configuration_reference():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f"{stage}.{f.name}" for stage, cls in STAGES.items() for f in fields(cls)
               if f"{stage}.{f.name}" not in text]
    assert missing == []


def test_every_decision_the_project_links_to_is_written_down():
    decisions = (ROOT / "docs" / "decisions.md").read_text()
    slugs = set(re.findall(r"^### ([a-z0-9-]+)\s*$", decisions, flags=re.M))
    linked = set()
    for folder in ("xc_dagster", "assets", "resources", "bench", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md"):
                linked |= set(re.findall(r"decisions\.md#([a-z0-9-]+)", path.read_text()))
    linked |= set(re.findall(r"decisions\.md#([a-z0-9-]+)", (ROOT / "README.md").read_text()))
    assert linked and linked <= slugs, sorted(linked - slugs)
