"""docs/flags.md is the configuration's flag table: every `meshlm train` flag with its default and help."""

from __future__ import annotations

import re

from meshlm.config import flag_fields
from meshlm.config.flag_table import markdown
from tests.support.cli import ROOT


def test_the_flag_page_is_written_from_the_configuration():
    page = (ROOT / "docs" / "flags.md").read_text()
    assert page == markdown(), "docs/flags.md is stale: python -m meshlm.config.flag_table > docs/flags.md"


def test_every_flag_is_documented_with_its_default():
    page = (ROOT / "docs" / "flags.md").read_text()
    rows = {
        name: cell.strip().replace("\\|", "|")
        for name, cell in re.findall(r"^\| `--(\w+)` \| ((?:[^|\\]|\\.)+) \|", page, re.M)
    }
    flags = {f.name: f.default for f in flag_fields() if f.metadata.get("cli", True)}
    assert set(rows) == set(flags)
    for name, default in flags.items():
        assert rows[name] == ("none" if default is None else "off" if default is False else f"`{default}`"), name


def test_defaults_the_other_pages_state_are_the_configuration_s():
    """A table row of one train flag that ends with its default in brackets, e.g. `| `--pp=N` | ... [1] |`."""
    flags = {f.name: f.default for f in flag_fields()}
    checked = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for name, said in re.findall(r"^\| `--(\w+)(?:=[^`]*)?` \|[^\n]*\[([\w.]+)\] \|$", page.read_text(), re.M):
            if name in flags and flags[name] is not None:
                assert float(said) == flags[name], f"{page.name}: --{name} [{said}], the default is {flags[name]}"
                checked += 1
    assert checked >= 4  # --pp, --virtual_stages (pipeline.md), --peer_timeout, --connect_timeout (distributed.md)
