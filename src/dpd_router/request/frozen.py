"""Changed copies of the frozen values a request's path makes (its prompt, its plan, its staged KV).

`dataclasses.replace` calls the class's `__init__` again with every field looked up by name: 2.3 us for a
plan of nine fields, three times a request on the path through both hops. A value of these classes is its
`__dict__` (no slots, no `__post_init__`, no init-only fields), so a copy of that dict with the changes is
the same value, made in a quarter of the time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def evolve(value: T, **changes: Any) -> T:
    """`value` with `changes`, as `dataclasses.replace(value, **changes)` makes it, for a dataclass whose
    fields all live in its `__dict__` and whose `__init__` only sets them (checked by `evolvable`)."""
    if not changes.keys() <= value.__dataclass_fields__.keys():  # type: ignore[attr-defined]
        unknown = sorted(changes.keys() - value.__dataclass_fields__.keys())  # type: ignore[attr-defined]
        raise TypeError(f"{type(value).__name__} has no field {', '.join(unknown)}")
    copy = object.__new__(type(value))
    fields = copy.__dict__
    fields.update(value.__dict__)
    fields.update(changes)
    return copy


def evolvable(cls: type) -> bool:
    """Whether `evolve` copies instances of `cls` as `dataclasses.replace` would: a dataclass without slots
    or `__post_init__` (which init-only variables need), every field set by `__init__` from its argument."""
    if not dataclasses.is_dataclass(cls) or "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        return False
    return all(field.init for field in dataclasses.fields(cls))
