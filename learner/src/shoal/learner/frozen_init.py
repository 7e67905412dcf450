"""A faster ``__init__`` for the frozen dataclasses built every iteration.

A frozen dataclass's generated ``__init__`` sets each field with its own
``object.__setattr__`` call; the trainer builds four such objects per iteration (the
assignment, the contribution, the sync's result and the iteration record: 35 fields), which
costs a small model's loop a few microseconds per iteration. :func:`fast_frozen_init` gives
such a class an ``__init__`` that sets the new instance's ``__dict__`` in one call instead,
with the same signature and the same ``__post_init__`` call: everything else (equality,
hashing, ``repr``, frozenness, ``dataclasses.replace``, pickling) stays the dataclass's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_frozen_init"]

T = TypeVar("T")


class _Factory:
    """The default of a field with a ``default_factory`` in the new ``__init__``'s signature
    (shown as the dataclass's own: ``<factory>``)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def fast_frozen_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of the frozen dataclass ``cls`` (plain fields only: every
    field in ``__init__``, positional or keyword, no ``InitVar``) by one that builds the
    instance's ``__dict__`` at once. Raises ``TypeError`` for any other class."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass with a generated __init__")
    if "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__} has __slots__: no __dict__ to set")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    for f in fields:
        if not f.init or f.kw_only or f.name == "self":
            raise TypeError(f"{cls.__name__}.{f.name}: only plain __init__ fields are supported")
    namespace: dict[str, Any] = {
        "_set": object.__setattr__,
        "_HAS_FACTORY": _FACTORY,
    }
    args: list[str] = []
    body: list[str] = []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_HAS_FACTORY")
            body.append(f"    if {f.name} is _HAS_FACTORY:\n")
            body.append(f"        {f.name} = _factory_{f.name}()\n")
        else:
            args.append(f.name)
    items = ", ".join(f"{f.name!r}: {f.name}" for f in fields)
    source = (
        f"def __init__(self, {', '.join(args)}):\n"
        + "".join(body)
        + f"    _set(self, '__dict__', {{{items}}})\n"
        + ("    self.__post_init__()\n" if hasattr(cls, "__post_init__") else "")
    )
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)  # (inspect.signature)
    cls.__init__ = init  # type: ignore[misc]
    return cls
