"""A learner's ``output.log`` (records of both pipes, see :mod:`shoal.host_agent.processes`) and
the words of its exit: the code or signal, the stop reason, its last traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_RECORD_TEXT",
    "NO_TRAIN",
    "STDERR",
    "STDOUT",
    "TRAIN_MARKER",
    "LogRecord",
    "crash_summary",
    "describe_exit",
    "read_log",
]

STDOUT, STDERR = 1, 2
MAX_RECORD_TEXT = 64 * 1024  # longer lines are split into several records


@dataclass(frozen=True)
class LogRecord:
    offset: int  # byte offset of the record in output.log
    stream: int  # STDOUT or STDERR
    text: str
    end: int  # offset just after the record
    time: float = 0.0  # when the learner wrote it (Unix seconds; 0: unknown)


def read_log(path: Path, offset: int, max_bytes: int = 1024 * 1024) -> list[LogRecord]:
    """Complete records of ``path`` from ``offset``. An offset inside a record starts at the
    next record, so "resume after a line" is ``line.offset + 1``."""
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return []
    with fh:
        if offset > 0:
            fh.seek(offset - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # skip the rest of the record we landed in
        position = fh.tell()
        data = fh.read(max_bytes)
    records: list[LogRecord] = []
    start = 0
    while True:
        newline = data.find(b"\n", start)
        if newline < 0:
            break
        raw = data[start:newline]
        stream = STDERR if raw[:1] == b"2" else STDOUT
        header, _, rest = raw.partition(b" ")
        written = 0.0
        if header[1:2] == b"@" and header[2:].isdigit():
            written = int(header[2:]) / 1000
            text = rest.decode(errors="replace")
        else:
            text = raw[2:].decode(errors="replace")
        records.append(LogRecord(position + start, stream, text, position + newline + 1, written))
        start = newline + 1
    return records


class _LogWriter:
    """Appends the records of both pipes to output.log and wakes followers."""

    def __init__(self, path: Path) -> None:
        self._fh = path.open("ab", buffering=0)
        self.changed = asyncio.Condition()
        self.version = 0  # bumped on every write

    async def write(self, stream: int, line: bytes) -> None:
        written = int(time.time() * 1000)
        for i in range(0, max(len(line), 1), MAX_RECORD_TEXT):
            chunk = line[i : i + MAX_RECORD_TEXT].replace(b"\n", b" ")
            self._fh.write(b"%d@%d %s\n" % (stream, written, chunk))
        self.version += 1
        async with self.changed:
            self.changed.notify_all()

    async def pump(self, stream: int, reader: asyncio.StreamReader | None) -> None:
        if reader is None:
            return
        pending = b""
        while True:
            chunk = await reader.read(64 * 1024)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                await self.write(stream, line.rstrip(b"\r"))
            while len(pending) > MAX_RECORD_TEXT:
                await self.write(stream, pending[:MAX_RECORD_TEXT])
                pending = pending[MAX_RECORD_TEXT:]
        if pending:
            await self.write(stream, pending)

    def close(self) -> None:
        self._fh.close()


TRAIN_MARKER = "train-called"  # the learner library touches it when the script calls train()
NO_TRAIN = (
    "exited with code 0 without calling Trainer.train() (nothing was trained: does the "
    'script call train() when run on the cluster, e.g. under `if __name__ == "__main__"`?)'
)


def crash_summary(log_path: Path, work_dir: Path | None = None, frames: int = 3) -> str:
    """The last Python traceback a learner printed, in one line: the exception type and
    message, then its last ``frames`` frames (``file:line in function``, paths relative to
    the learner's working directory); empty when its log has none."""
    try:
        size = log_path.stat().st_size
    except OSError:
        return ""
    records = read_log(log_path, max(0, size - 64 * 1024), 64 * 1024)
    lines = [r.text for r in records]
    start = max(
        (i for i, t in enumerate(lines) if t.startswith("Traceback (most recent call last):")),
        default=-1,
    )
    if start < 0:
        return ""
    block = lines[start:]
    exception = ""
    where: list[str] = []
    for text in block[1:]:
        stripped = text.strip()
        if text.startswith("  File "):
            # '  File "/x/work/train.py", line 12, in forward'
            try:
                quoted, _, rest = stripped[len("File ") :].partition(", line ")
                path = quoted.strip('"')
                number, _, func = rest.partition(", in ")
                if work_dir is not None and path.startswith(str(work_dir) + os.sep):
                    path = path[len(str(work_dir)) + 1 :]
                elif "site-packages" in path or path.startswith(sys.prefix):
                    path = Path(path).name
                where.append(f"{path}:{number} in {func}")
            except ValueError:
                continue
        elif text and not text.startswith((" ", "\t")):
            exception = stripped
            if not exception.startswith(("During handling", "The above exception")):
                break
    if not exception:
        return ""
    if len(exception) > 300:
        exception = exception[:297] + "..."
    trail = ", ".join(where[-frames:])
    return f"{exception} (at {trail})" if trail else exception


def describe_exit(code: int, stop: str | None) -> str:
    if code >= 0:
        text = f"exited with code {code}"
    else:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by {name}"
    return f"{text} ({stop})" if stop else text
