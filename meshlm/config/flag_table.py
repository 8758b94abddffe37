"""docs/flags.md, written from the sections: every `meshlm train` flag with its default and meaning, one
table per section (`meshlm explain` takes the same flags; `meshlm plan` the job's).

    python -m meshlm.config.flag_table > docs/flags.md     (tests/test_flag_table.py keeps the page current)
"""

from __future__ import annotations

import dataclasses

from meshlm.config.sections import SECTIONS

HEADER = """# Flags of `meshlm train`

Every flag of `meshlm train` (and `meshlm explain`), by section, as `meshlm train --help` lists them; the
model's own fields are set with `--model.FIELD=VALUE`. Written from `meshlm/config/sections.py` by
`python -m meshlm.config.flag_table > docs/flags.md`; a test fails when the two differ. How the flags
are built and checked: [configuration.md](configuration.md).
"""


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")


def _default(value) -> str:
    return "none" if value is None else "off" if value is False else f"`{value}`"


def markdown() -> str:
    """The whole page."""
    parts = [HEADER]
    for title, cls in SECTIONS.items():
        parts.append(f"## {title}\n\n{' '.join((cls.__doc__ or '').split())}\n")
        rows = ["| flag | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                rows.append(f"| `--{f.name}` | {_cell(_default(f.default))} | {_cell(f.metadata.get('help', ''))} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(markdown(), end="")
