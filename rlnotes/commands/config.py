"""`rlnotes config [OVERRIDES...] [KEY...] [--markdown]`: every setting of the config a run would
get, grouped by section, each with its value (after the chosen presets and overrides), its type, its
valid range or options, and what it means: the comment above its field in the schema, the one text
that explains a setting (rlnotes.core.comments).

A command of its own, taking the overrides `rlnotes train` takes, because that is where a user looks
for "what does this setting do, and what will my run use": `rlnotes config algo=ppo` lists PPO's
keys with the values its preset gives them, and adding `algo` (or `trainer`, `model.lora.r`) keeps
only those keys. `rlnotes train --help` stays Hydra's own (the config groups and the raw YAML), where
neither meanings nor ranges have a place. It answers in about a second: it imports neither torch
nor transformers, reading each algorithm's schema, ranges and options from its module's
source (rlnotes.commands.declared). It lists, it does not check values: `rlnotes train` does.

docs/config.md is `rlnotes config --markdown`: the same for the default run, and each algo= option's
own section (tests/test_config_command.py fails when the file is not what this writes).
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape

from rlnotes.commands import hydra
from rlnotes.commands.declared import Declared, declarations
from rlnotes.commands.explain import explain
from rlnotes.commands.usage import Parser, UsageError
from rlnotes.commands.validate import register
from rlnotes.core.checks import (
    DEVICES,
    DIRECTIONS,
    ENGINES,
    ENV_FORMS,
    ENV_STYLES,
    PRECISIONS,
    RANGES,
    SCHEDULES,
    STRATEGIES,
    THREADS,
    range_text,
)
from rlnotes.core.comments import comments, field_type
from rlnotes.core.schema import TrainConfig
from rlnotes.data.settings import OVERLONG, SOURCES

# Settings that name one of a fixed set of options, and the tables the checks hold them to
# (an algorithm's own are its declaration's `choices`).
CHOICES = {"optim.schedule": SCHEDULES, "hardware.device": DEVICES, "hardware.precision": PRECISIONS,
           "hardware.strategy": STRATEGIES, "rollout.engine": ENGINES, "rollout.env_style": ENV_STYLES,
           "sweep.direction": DIRECTIONS, "data.source": SOURCES, "data.overlong": OVERLONG}
# Config groups, in the order of conf/config.yaml's defaults.
GROUPS = ("algo", "model", "reward", "data", "hardware", "rollout", "logging", "experiment")
REGENERATE = "rlnotes config --markdown > docs/config.md"


@dataclass
class Setting:
    key: str
    kind: str       # its type in words
    value: Any      # as composed
    valid: str      # its range or options in words, or ""
    comment: str


@dataclass
class Section:
    key: str                      # "" for the top-level settings
    comment: str
    settings: List[Setting] = field(default_factory=list)
    null: bool = False            # a section set to null (model.lora=null)


def compose(overrides: List[str], config_dir: Optional[str] = None):
    """The loader and the config `rlnotes train OVERRIDES` would run (the hydra node included),
    composed against the schemas as the algorithm modules declare them; a mistake is one UsageError line."""
    register()
    loader = hydra.config_loader(config_dir)
    try:
        return loader, hydra.compose(loader, overrides)
    except hydra.COMPOSE_ERRORS as e:
        raise UsageError(explain(e, loader, overrides)) from None


def kind_text(kind) -> str:
    """A field's type in words: int, float or null, list of str, dict, any."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union:
        return " or ".join(kind_text(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(kind) is list:
        return "list of items (below)" if dataclasses.is_dataclass(args[0]) else f"list of {kind_text(args[0])}"
    if typing.get_origin(kind) is dict:
        return "dict"
    return "any" if kind is Any else "section" if dataclasses.is_dataclass(kind) else kind.__name__


def valid_text(key: str, ranges: Dict[str, str], choices: Dict[str, tuple]) -> str:
    if key in ranges:
        return range_text(ranges[key])
    if key in choices:
        return "one of: " + ", ".join(map(str, choices[key]))
    return {"hardware.threads": THREADS, "rollout.env": ENV_FORMS}.get(key, "")


def sections(cfg, algo: Declared) -> List[Section]:
    """The sections of a composed config, in the schema's order; nested ones after their parent."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    ranges, choices = {**RANGES, **algo.ranges}, {**CHOICES, **algo.choices}
    top = Section("", "Settings outside any section.")
    out = [top]
    notes = comments(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        schema = algo.schema if f.name == "algo" else field_type(TrainConfig, f.name)
        if dataclasses.is_dataclass(schema):
            out += _walk(schema, plain[f.name], f.name, notes[f.name], ranges, choices,
                         algo.comments if f.name == "algo" else None)
        else:
            top.settings.append(Setting(f.name, kind_text(hints[f.name]), plain[f.name],
                                        valid_text(f.name, ranges, choices), notes[f.name]))
    return [s for s in out[1:] + [top] if s.settings or s.null]


def _walk(schema, values, key, comment, ranges, choices, notes=None) -> List[Section]:
    """The section `key` of dataclass `schema` (composed `values`), then the sections it nests;
    the fields of a list's items as `key[].field` with their schema defaults."""
    section, nested = Section(key, comment, null=values is None), []
    notes, hints, defaults = notes or comments(schema), typing.get_type_hints(schema), _defaults(schema)
    for f in dataclasses.fields(schema) if values is not None else ():
        kind, sub = field_type(schema, f.name), f"{key}.{f.name}"
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if dataclasses.is_dataclass(kind):
            nested += _walk(kind, values[f.name], sub, notes[f.name], ranges, choices)
            continue
        section.settings.append(Setting(sub, kind_text(hints[f.name]), values.get(f.name, defaults.get(f.name)),
                                        valid_text(sub, ranges, choices), notes[f.name]))
        if dataclasses.is_dataclass(item):
            nested += _walk(item, _defaults(item), f"{sub}[]", f"Each item of {sub}.", ranges, choices)
    return [section, *nested]


def _defaults(schema) -> Dict[str, Any]:
    """A schema's defaults, plain (MISSING as "???", which the listing shows as required)."""
    return OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)


# ---------------------------------------------------------------------------------------------
# Showing them


def shown(value) -> str:
    """A value as it is written in YAML or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "???":
        return "(required)"
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and (not value or any(c in value for c in " ,:[]{}#'\"\n") or value in ("null", "true")):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return str(value)


def chosen_groups(cfg) -> Dict[str, Optional[str]]:
    choices = cfg.hydra.runtime.choices
    return {group: choices.get(group) for group in GROUPS}


def print_terminal(console: Console, loader, cfg, found: List[Section], groups: bool = True) -> None:
    """The sections as text, each comment wrapped to the console's width; the config groups first."""
    if groups:
        console.print("[bold]config groups[/] (group=option)")
        for group, option in chosen_groups(cfg).items():
            console.print(f"  {group}: [bold cyan]{option or '(none)'}[/]  [dim]options: "
                          f"{', '.join(hydra.group_options(loader, group))}[/]")
    wrap = lambda text, indent: textwrap.fill(text, max(console.width, 60), initial_indent=" " * indent,  # noqa: E731
                                              subsequent_indent=" " * indent, break_on_hyphens=False)
    for i, section in enumerate(found):
        console.print(("\n" if groups or i else "") + f"[bold underline]{escape(section.key or 'top level')}[/]"
                      + (" = null" if section.null else ""))
        console.print(escape(wrap(section.comment, 2)), style="dim")
        for s in section.settings:
            meta = ", ".join(x for x in (s.kind, s.valid) if x)
            console.print(f"  [bold cyan]{escape(s.key)}[/] = [green]{escape(shown(s.value))}[/]  [dim]({escape(meta)})[/]")
            console.print(escape(wrap(s.comment, 6)))


def select(found: List[Section], keys: List[str]) -> List[Section]:
    """The settings under any of `keys` (a section, a key, or a section's prefix)."""
    if not keys:
        return found
    under = lambda k: any(k == p or k.startswith(p + ".") or k.startswith(p + "[]") for p in keys)  # noqa: E731
    out = [dataclasses.replace(s, settings=[x for x in s.settings if under(x.key)]) for s in found]
    out = [s for s in out if s.settings or (s.null and under(s.key))]
    if not out:
        known = [x.key for s in found for x in s.settings] + [s.key for s in found if s.key]
        close = [m for k in keys for m in difflib.get_close_matches(k, known, n=1)]
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UsageError(f"no setting is {' or '.join(keys)}; {hint}sections: "
                         f"{', '.join(s.key for s in found if s.key)}, or top-level keys such as seed")
    return out


# ---------------------------------------------------------------------------------------------
# docs/config.md


def _md(text: str) -> str:
    """Comment text for Markdown: * and < escaped outside `code` (G*R, <tool_call>)."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*").replace("<", "\\<") for i, p in enumerate(parts))


def markdown_settings(settings: List[Setting]) -> List[str]:
    return [f"- `{s.key}` = `{shown(s.value)}` ({', '.join(x for x in (s.kind, s.valid) if x)}): {_md(s.comment)}"
            for s in settings]


def markdown_sections(found: List[Section]) -> List[str]:
    lines = []
    for section in found:
        title = f"`{section.key}`" if section.key else "Top level"
        lines += ["", f"### {title}" + (" = `null`" if section.null else ""), "", _md(section.comment), ""]
        lines += markdown_settings(section.settings)
    return lines


INTRO = """Every key of the config `rlnotes train` composes: its value after the chosen presets (conf/), its
type, its valid range or options, and what it means. The text is the comment above each field in
the schemas (rlnotes/core/schema.py, data_schema.py, rollout_schema.py, and each algorithm's own in
its module under rlnotes/algos/); a value out of range is refused with the first sentence of it.
Set any key on the command line (`trainer.steps=100`) or in an experiment file (conf/experiment/).

`rlnotes config [OVERRIDES...] [KEY...]` prints the same in a terminal for any composition:
`rlnotes config algo=ppo algo` lists PPO's keys, `rlnotes config model=smollm2-135m model` the model
section that preset gives."""


def markdown(overrides: List[str] = (), config_dir: Optional[str] = None) -> str:
    """docs/config.md: the run of `overrides` section by section, then each algo= option's section
    (and what else its preset sets)."""
    loader, cfg = compose(list(overrides), config_dir)
    algos = declarations()
    base = sections(cfg, algos[cfg.algo.name])
    lines = [f"<!-- Generated by `{REGENERATE}` from the schemas' comments: edit those, not this file. -->",
             "", "# Settings", "", INTRO, "", "## Config groups", "",
             "Chosen with `group=option`; the default run's option in bold.", ""]
    for group, option in chosen_groups(cfg).items():
        options = [f"**{o}**" if o == option else o for o in hydra.group_options(loader, group)]
        lines.append(f"- `{group}`: {', '.join(options)}" + ("" if option else " (none by default)"))
    command = " ".join(["rlnotes train", *overrides])
    lines += ["", f"## The run: `{command}`", "", "Every section but `algo`, which is each algorithm's own "
              "([Algorithms](#algorithms)).", *markdown_sections([s for s in base if s.key.split(".")[0] != "algo"])]
    return "\n".join(lines + _algorithms(loader, list(overrides), config_dir, base)) + "\n"


def _algorithms(loader, overrides: List[str], config_dir: Optional[str], base: List[Section]) -> List[str]:
    """Each algorithm's algo section once, with the value each algo= option it serves gives a key, and
    what else an option's preset sets (keys outside algo it changes)."""
    algos, values = declarations(), {s.key: s.value for section in base for s in section.settings}
    runs: Dict[str, Dict[str, Any]] = {}  # algo.name -> {option: its composed sections}
    for option in hydra.group_options(loader, "algo"):
        _, cfg = compose([*overrides, f"algo={option}"], config_dir)
        runs.setdefault(cfg.algo.name, {})[option] = sections(cfg, algos[cfg.algo.name])
    first = next(iter(next(iter(runs.values())).values()))[0].settings
    lines = ["", "## Algorithms", "", "The `algo` section of each `algo=` option (conf/algo/), grouped by the "
             "algorithm that trains it (its module in rlnotes/algos/), with the value each option gives a key. "
             "Every option sets these two:", "", *markdown_settings([dataclasses.replace(s, value="...") for s in first
                                                                if s.key in ("algo.preset", "algo.name")])]
    for name, options in runs.items():
        lines += ["", f"### `{name}`: " + ", ".join(f"`algo={o}`" for o in options), "",
                  f"rlnotes/algos/{algos[name].path.name}; default task: `{algos[name].default_task}`."]
        for option, found in options.items():
            also = [f"`{s.key}` = `{shown(s.value)}`" for section in found if section.key.split(".")[0] != "algo"
                    for s in section.settings if values.get(s.key) != s.value]
            lines += [f"`algo={option}` also sets {', '.join(also)}."] if also else []
        own = [(i, s) for i, s in enumerate(next(iter(options.values()))[0].settings)
               if s.key not in ("algo.preset", "algo.name")]
        lines += [""] if own else ["No keys of its own beyond those two."]
        for i, s in own:
            by_value: Dict[str, List[str]] = {}
            for option, found in options.items():
                by_value.setdefault(shown(found[0].settings[i].value), []).append(option)
            value = "; ".join(f"`{v}`" + (f" ({', '.join(o)})" if len(by_value) > 1 else "") for v, o in by_value.items())
            meta = ", ".join(x for x in (s.kind, s.valid) if x)
            lines.append(f"- `{s.key}` = {value} ({meta}): {_md(s.comment)}")
    return lines


def main(argv: List[str]) -> int:
    """`rlnotes config [OVERRIDES...] [KEY...] [--markdown] [--config-dir DIR]`."""
    parser = Parser(prog="rlnotes config", description="Every setting of the config `rlnotes train` would compose "
                    "from the same overrides: its value, type, valid range or options, and meaning.")
    parser.add_argument("args", nargs="*", metavar="OVERRIDE|KEY", help="overrides as for rlnotes train "
                        "(algo=ppo, trainer.steps=10); a KEY without '=' keeps only that section or key "
                        "(algo, trainer, model.lora.r)")
    parser.add_argument("--markdown", action="store_true", help="the whole page as Markdown, each algo= option's "
                        f"section included (docs/config.md: {REGENERATE})")
    parser.add_argument("--config-dir", metavar="DIR", help="your own config files, searched before rlnotes' own "
                        "(as for rlnotes train)")
    args = parser.parse_args(argv)
    overrides = [a for a in args.args if "=" in a or a[:1] in "+~"]
    keys = [a for a in args.args if a not in overrides]
    if args.markdown:
        if keys:
            raise UsageError(f"--markdown writes the whole page; drop {' '.join(keys)} (or drop --markdown)")
        print(markdown(overrides, args.config_dir), end="")
        return 0
    loader, cfg = compose(overrides, args.config_dir)
    found = select(sections(cfg, declarations()[cfg.algo.name]), keys)
    # soft_wrap: a key's line stays one line (grep finds it); comments are wrapped to the width here.
    print_terminal(Console(highlight=False, soft_wrap=True), loader, cfg, found, groups=not keys)
    return 0
