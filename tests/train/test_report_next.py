"""The `next:` hint spells meshlm as it runs from the user's shell: `.venv/bin/meshlm` after `make` (the README's
set-up puts it in .venv, not on PATH), `meshlm` where PATH finds this installation's command."""

import sys

import pytest

from meshlm.train import report


@pytest.fixture
def venv(tmp_path, monkeypatch):
    """A virtualenv in the working folder whose python runs this process, with its meshlm script."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("")
    (bin_dir / "meshlm").write_text("#!/bin/sh\n")
    (bin_dir / "meshlm").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    return bin_dir


def test_after_make_the_hint_is_the_venvs_command(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert report.meshlm_command() == ".venv/bin/meshlm"
    assert (
        report.generate_command("outputs/run") == ".venv/bin/meshlm generate --checkpoint=outputs/run --prompt='def '"
    )
    assert report.generate_command("run", chat=True).startswith(".venv/bin/meshlm serve --checkpoint=run")


def test_from_another_folder_the_hint_is_the_whole_path(venv, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert report.meshlm_command() == str(venv / "meshlm")


def test_with_the_venv_activated_the_hint_is_meshlm(venv, monkeypatch):
    monkeypatch.setenv("PATH", f"{venv}:/usr/bin:/bin")
    assert report.meshlm_command() == "meshlm"


def test_the_finished_run_message_uses_it_too(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert "`.venv/bin/meshlm generate --checkpoint=run" in report.already_done("run", 2, 2)
