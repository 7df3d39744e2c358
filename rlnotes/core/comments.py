"""The comment above each field of a config schema: the one text that explains a setting.

A field's comment is the run of `#` lines directly above it in its dataclass (rlnotes/core/schema.py,
rollout_schema.py, each algorithm's schema in its module in rlnotes/algos/). Its first sentence says what the
setting is, short enough to close an error line (`algo.beta=-0.1 must be at least 0 (...)`); what
follows is detail: units, what null means, the paper's value. `rlnotes config` and docs/config.md
print the whole comment, range errors its first sentence. Read from the .py source, which ships in
the wheel; parsed once per file.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import typing
from typing import Dict, Optional

# Words whose period does not end a sentence: "et al. 2025", "Dr. GRPO", "Sec. 3.2", "e.g. 2".
ABBREVIATIONS = ("al", "Dr", "Sec", "Eq", "e.g", "i.e", "cf", "vs", "etc", "approx")


@functools.lru_cache(maxsize=None)
def file_comments(path: str) -> Dict[str, Dict[str, str]]:
    """{class name: {field: comment}} of the top-level classes of a Python file (fields with a
    comment only; a comment's lines joined by spaces)."""
    text = open(path, encoding="utf-8").read()
    lines = text.splitlines()
    out: Dict[str, Dict[str, str]] = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        found = out.setdefault(node.name, {})
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, i = [], stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                if above:
                    found[stmt.target.id] = " ".join(above)
    return out


def comments(schema: type) -> Dict[str, str]:
    """{field: comment} of a dataclass schema; a field it redeclares without a comment keeps the
    comment of the class it inherits the field from."""
    out: Dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls):
            out.update(file_comments(source_file(cls)).get(cls.__name__, {}))
    return out


def source_file(cls: type) -> str:
    """The .py file a class is written in. An algorithm's schema made from its class statement alone
    (rlnotes.commands.declared: its module is not imported) names it in __source_file__."""
    return vars(cls).get("__source_file__") or inspect.getsourcefile(cls)


def field_type(schema: type, name: str):
    """The type of a field, Optional[X] as X (the type the value has when it is not null)."""
    kind = typing.get_type_hints(schema)[name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) is typing.Union and len(args) == 1 else kind


def comment(schema: type, key: str) -> Optional[str]:
    """The comment of a dotted key (`model.lora.r`) of a schema and the dataclasses it nests."""
    first, _, rest = key.partition(".")
    if not rest:
        return comments(schema).get(first)
    inner = field_type(schema, first)
    return comment(inner, rest) if dataclasses.is_dataclass(inner) else None


def summary(text: str) -> str:
    """A comment's first sentence without its period, lowercased where it starts with a plain word
    ("Optimizer steps." -> "optimizer steps"; "AdamW's step size." keeps its capital)."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "." and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            if re.split(r"[\s(]", text[:i])[-1] not in ABBREVIATIONS:
                text = text[:i]
                break
    first = re.match(r"[A-Za-z'-]*", text).group()
    return text[0].lower() + text[1:] if re.fullmatch(r"[A-Z][a-z'-]+", first) else text
