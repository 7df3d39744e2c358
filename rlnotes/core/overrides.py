"""A value written as Hydra's override grammar reads it: for a command line that rlnotes prints
(the command that resumes a run) or advises (a value the grammar reads only quoted)."""

from __future__ import annotations

import re

# What Hydra's override grammar reads unquoted in a value (spaces too, but not at either end).
_UNQUOTED = re.compile(r"[A-Za-z0-9_\-/+.%@:]+")


def override_value(text: str) -> str:
    """`text` as a value Hydra's override grammar reads back as `text`: as it is when every
    character may stand unquoted, else in single quotes, a quote (and any backslashes before it)
    and an interpolation's `${` escaped with a backslash. A path with another letter than ASCII's,
    `~`, a space, a quote or brackets then survives a command line that is pasted."""
    if _UNQUOTED.fullmatch(text):
        return text
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text).replace("${", "\\${")
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)  # else the last would escape the closing quote
    return f"'{escaped}'"
