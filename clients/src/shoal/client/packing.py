"""What ``shoal submit`` uploads: a model directory as a deterministic tar.gz, without what
the user's ``.gitignore`` and ``.shoalignore`` files exclude (git's syntax, in the directory and
in any subdirectory, as git reads them), nor ``.git/``, ``.shoal/`` (a local cluster's state),
``__pycache__/`` and ``*.pyc``.

As in git, the patterns of an ignore file in ``sub/`` are relative to ``sub/`` and apply only
below it; for a path, the deepest ignore file with a matching pattern decides (within one
directory the last matching line, ``.shoalignore``'s after ``.gitignore``'s), so ``!keep.txt``
in ``sub/.gitignore`` re-includes what the top's ``*.txt`` excluded; and a file inside an
excluded directory cannot be re-included (the directory is never entered).

The patterns are matched by ``pathspec`` (its ``GitIgnoreSpec`` follows git's rules, negation
and directory patterns included), a small, well-kept library that black and mypy depend on.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

ALWAYS_IGNORED = [".git/", ".shoal/", "__pycache__/", "*.pyc"]
IGNORE_FILES = (".gitignore", ".shoalignore")


@dataclass(frozen=True)
class Packed:
    """A packed directory: the archive, and how many files and bytes went into it."""

    data: bytes
    files: int
    file_bytes: int
    ignored: int


def ignore_spec(directory: Path, *, top: bool = False) -> pathspec.GitIgnoreSpec | None:
    """The patterns of ``directory``'s ignore files (with the always-ignored ones at the top),
    or None when it has none."""
    lines = list(ALWAYS_IGNORED) if top else []
    found = top
    for name in IGNORE_FILES:
        try:
            lines += (directory / name).read_text(errors="replace").splitlines()
        except OSError:
            continue
        found = True
    return pathspec.GitIgnoreSpec.from_lines(lines) if found else None


def _ignored(specs: list[tuple[Path, pathspec.GitIgnoreSpec]], rel: Path, is_dir: bool) -> bool:
    """Whether ``rel`` (relative to the top) is ignored: the deepest spec with a matching
    pattern decides. ``specs`` are the ignore files of ``rel``'s ancestors, top first."""
    ignored = False
    for base, spec in specs:
        text = rel.relative_to(base).as_posix() + ("/" if is_dir else "")
        include = spec.check_file(text).include
        if include is not None:
            ignored = include
    return ignored


def selected_files(root: Path) -> tuple[list[Path], int]:
    """The files and directories to pack, sorted, and how many files were ignored."""
    top = ignore_spec(root, top=True)
    assert top is not None
    specs_at: dict[Path, list[tuple[Path, pathspec.GitIgnoreSpec]]] = {
        Path("."): [(Path("."), top)]
    }
    chosen: list[Path] = []
    ignored = 0
    for current, dirs, files in os.walk(root):
        here = Path(current)
        rel_dir = here.relative_to(root)
        specs = specs_at.pop(rel_dir)
        kept_dirs = []
        for d in sorted(dirs):
            rel = rel_dir / d
            if _ignored(specs, rel, True):
                ignored += sum(len(f) for _, _, f in os.walk(here / d))
                continue
            kept_dirs.append(d)
            chosen.append(here / d)
            own = ignore_spec(here / d)
            specs_at[rel] = [*specs, (rel, own)] if own is not None else specs
        dirs[:] = kept_dirs
        for f in files:
            if _ignored(specs, rel_dir / f, False):
                ignored += 1
                continue
            chosen.append(here / f)
    return sorted(chosen), ignored


def pack(root: str | Path) -> Packed:
    """A deterministic tar.gz of ``root`` (sorted names, zeroed times and owners), so the same
    directory always has the same content address."""
    root = Path(root)
    paths, ignored = selected_files(root)
    buf = io.BytesIO()
    files = size = 0
    # The gzip header's time is zeroed too (tarfile's "w:gz" writes the current second there,
    # which made two packs a second apart differ).
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for path in paths:
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_file():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
                files += 1
                size += info.size
            else:
                tar.addfile(info)
    return Packed(buf.getvalue(), files, size, ignored)
