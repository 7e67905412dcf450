"""How the CLI prints: JSON whose numbers are numbers, tables that never cut a value, ages,
and the kubectl habit of ``-o FORMAT`` anywhere on the command line."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
# Options that take a value, so that the word after them is never mistaken for ``-o``.
OUTPUT_FLAGS = ("-o", "--output")


def _numbers(descriptor: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    """Turn the strings ``MessageToDict`` writes for 64-bit integers (proto3 JSON mapping)
    back into numbers, recursively; well-known types (Timestamp, ...) stay as they are."""
    if descriptor.full_name.startswith("google.protobuf."):
        return data
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            val = sub.fields_by_name["value"]
            if val.message_type is not None:
                data[field.name] = {k: _numbers(val.message_type, v) for k, v in value.items()}
            elif val.type in _INT64:
                data[field.name] = {k: int(v) for k, v in value.items()}
        elif sub is not None:
            if isinstance(value, list):
                data[field.name] = [_numbers(sub, v) if isinstance(v, dict) else v for v in value]
            elif isinstance(value, dict):
                data[field.name] = _numbers(sub, value)
        elif field.type in _INT64:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return data


def message_to_dict(message: Message) -> dict[str, Any]:
    """A message as JSON-ready data: field names as in the .proto, every field present (zeros
    too, so scripts need no defaults), 64-bit integers as numbers, enums as names."""
    data = MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return _numbers(message.DESCRIPTOR, data)


def to_data(value: Any) -> Any:
    if isinstance(value, Message):
        return message_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {k: to_data(v) for k, v in value.items()}
    return value


def age(seconds_since_epoch: float, now: float | None = None) -> str:
    """kubectl's AGE: ``45s``, ``12m``, ``3h``, ``2d``; ``-`` when unknown."""
    if not seconds_since_epoch:
        return "-"
    delta = max(0, int((time.time() if now is None else now) - seconds_since_epoch))
    if delta < 120:
        return f"{delta}s"
    if delta < 2 * 3600:
        return f"{delta // 60}m"
    if delta < 2 * 86400:
        return f"{delta // 3600}h"
    return f"{delta // 86400}d"


def timestamp_seconds(ts: Any) -> float:
    return float(ts.seconds) + ts.nanos / 1e9 if ts is not None else 0.0


def iso_time(seconds: float) -> str:
    if not seconds:
        return ""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def plain_table(*columns: str) -> Table:
    """A kubectl-like table: no box, bold header; printed with :func:`print_table`."""
    return Table(*columns, box=None, pad_edge=False, header_style="bold", show_edge=False)


def print_table(console: Console, table: Table) -> None:
    """Print a table at its natural width, never narrower: a value (a job id, a state) is
    never cut or wrapped, so it can be copied; a terminal that is too narrow wraps the line
    as it does for ``kubectl get``."""
    for column in table.columns:
        column.no_wrap = True
        column.overflow = "ignore"
    wide = Console(width=10_000)
    natural = Measurement.get(wide, wide.options, table).maximum
    before = console.width
    console.width = max(natural, before)  # rich clamps print(width=) to the console's width
    try:
        console.print(table, crop=False, soft_wrap=False)
    finally:
        console.width = before


def hoist_output_option(args: Sequence[str]) -> list[str]:
    """Move ``-o FORMAT`` / ``--output FORMAT`` / ``--output=FORMAT`` / ``-oFORMAT`` from
    wherever it is to the front, where the global option is parsed: ``shoal jobs list -o json``
    works as ``shoal -o json jobs list`` (kubectl's habit). Words after ``--`` and the value of
    an option that takes one (``--arg -o``) are left alone."""
    args = list(args)
    front: list[str] = []
    rest: list[str] = []
    i = 0
    takes_value = {"--arg", "--entry", "--name", "--dataset", "--out", "--loss-out", "--logdir"}
    while i < len(args):
        word = args[i]
        if word == "--":
            rest.extend(args[i:])
            break
        if word in takes_value and i + 1 < len(args):
            rest.extend(args[i : i + 2])
            i += 2
            continue
        if word in OUTPUT_FLAGS and i + 1 < len(args):
            front = [word, args[i + 1]]
            i += 2
            continue
        if word.startswith("--output="):
            front = ["--output", word.split("=", 1)[1]]
            i += 1
            continue
        if word.startswith("-o") and len(word) > 2 and not word.startswith("--"):
            front = ["-o", word[2:]]
            i += 1
            continue
        rest.append(word)
        i += 1
    return front + rest
