"""What ``shoal submit`` uploads: a model directory as a deterministic tar.gz, without what
the user's ``.gitignore`` and ``.shoalignore`` (git's syntax, at the directory's top) exclude,
nor ``.git/``, ``.shoal/`` (a local cluster's state), ``__pycache__/`` and ``*.pyc``.

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


def ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    lines = list(ALWAYS_IGNORED)
    for name in IGNORE_FILES:
        try:
            lines += (root / name).read_text(errors="replace").splitlines()
        except OSError:
            continue
    return pathspec.GitIgnoreSpec.from_lines(lines)


def selected_files(root: Path) -> tuple[list[Path], int]:
    """The files and directories to pack, sorted, and how many files were ignored."""
    spec = ignore_spec(root)
    chosen: list[Path] = []
    ignored = 0
    for current, dirs, files in os.walk(root):
        here = Path(current)
        rel_dir = here.relative_to(root)
        kept_dirs = []
        for d in sorted(dirs):
            rel = (rel_dir / d).as_posix()
            if spec.match_file(rel + "/"):
                ignored += sum(len(f) for _, _, f in os.walk(here / d))
                continue
            kept_dirs.append(d)
            chosen.append(here / d)
        dirs[:] = kept_dirs
        for f in files:
            if spec.match_file((rel_dir / f).as_posix()):
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
