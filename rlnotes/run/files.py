"""Writing the files of a run, an evaluation or a sweep so that nothing outside them changes.

A whole file (config.yaml, result.json, a summary, an evaluation's samples) is written aside and
renamed into place (`write_text`): a reader never sees half of it, and the rename replaces the
name, not the file it named, so a symbolic link planted in its place, or a hard-linked copy of the
dir (`cp -al`), leaves the other file as it was. A log that grows line by line (metrics.jsonl,
samples.jsonl, warnings.log, eval.jsonl) is opened with `append`, which refuses a symbolic link
and first gives a file hard-linked elsewhere a copy of its own (`detach`). `symlinks` lists the
links in a dir, which a run dir must not hold (rlnotes.run.rundir).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import List, TextIO

from rlnotes.core.errors import ConfigError

# errno values that mean the disk (or the user's quota) is full.
FULL = (errno.ENOSPC, errno.EDQUOT)


def is_full(error: BaseException) -> bool:
    """Whether `error` is a write that found no space left (the disk, or a quota)."""
    return isinstance(error, OSError) and error.errno in FULL


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _refuse_link(path: Path) -> None:
    raise ConfigError(f"{path} is a symbolic link ({os.readlink(path)}); rlnotes writes its files in place of "
                      "links, never through them: remove the link, or write to another dir") from None


def write_text(path: Path, text: str) -> None:
    """Write `text` to a new file beside `path`, then rename it to `path` (see the module's docstring)."""
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """`write_text` for bytes (a figure, a table)."""
    path = Path(path)
    tmp = _aside(path)
    if os.path.lexists(tmp):  # left by a process of the same pid that died while writing
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def detach(path: Path) -> None:
    """Give the file at `path` a copy of its own when it is hard-linked elsewhere (its bytes copied
    aside and renamed over it), so that writing to it changes no other name's file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_nlink > 1 and not os.path.islink(path) and os.path.isfile(path):
        tmp = _aside(Path(path))
        shutil.copy2(path, tmp)
        os.replace(tmp, path)


def append(path: Path) -> TextIO:
    """`path` opened to add text at its end (created if new): never through a symbolic link (a
    one-line ConfigError), and a file hard-linked elsewhere is first `detach`ed."""
    path = Path(path)
    if os.path.islink(path):
        _refuse_link(path)
    detach(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link made since the check above
            _refuse_link(path)
        raise
    return os.fdopen(fd, "a")


def detach_tree(root: Path, skip=(), deep: bool = True) -> None:
    """`detach` every file under `root` (deep=False: in it), but those under its top-level entries
    named in `skip` (dirs whose files are never written in place, such as checkpoints)."""
    root = Path(root)
    for top, dirs, names in os.walk(root):
        if Path(top) == root:
            dirs[:] = [d for d in dirs if d not in skip] if deep else []
        for name in names:
            detach(Path(top) / name)


def symlinks(root: Path) -> List[Path]:
    """Every symbolic link under the dir `root` (links to dirs are listed, not followed)."""
    found = []
    for top, dirs, names in os.walk(root):
        found += [Path(top) / name for name in (*dirs, *names) if os.path.islink(os.path.join(top, name))]
    return sorted(found)
