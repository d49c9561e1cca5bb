"""The base of a method's launch options and the checks they share (see :mod:`sparseflow.tuning`).

Its own module, as :mod:`sparseflow._config_base` is for configs: the methods' option classes
and the registry build on it, and :mod:`sparseflow.tuning` reads the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Tuple

__all__ = ["MethodTuning", "choice_field", "check_choice", "check_optional_int", "check_bool"]


def choice_field(default: Any, schema: str) -> Any:
    """A tuning field whose op-schema type is ``schema`` (``"str"``, ``"bool"``, ``"int?"``)."""
    return field(default=default, metadata={"schema": schema})


@dataclass(frozen=True)
class MethodTuning:
    """Base of a method's own launch options (``methods/<m>/tuning.py``), carried by its registry
    entry (``MethodSpec.tuning_type``). Its fields take the ``Tuning`` keyword
    ``<method>_<field>`` (``Tuning(pbs_select="triton")``) and become the method op's arguments
    under that name. ``shared``: the fields of :class:`Tuning` itself the method's op also takes
    (launch mechanics the core provides)."""

    method: ClassVar[str] = ""
    shared: ClassVar[Tuple[str, ...]] = ("cuda_graphs",)

    def label(self, name: str) -> str:
        """How errors name a field: as the user writes it on :class:`Tuning`."""
        return f"Tuning.{self.method}_{name}"


def check_choice(owner: str, value: Any, choices: Tuple) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner} must be a str, one of {list(choices)}, got {type(value).__name__} ({value!r})")
    if value not in choices:
        raise ValueError(f"{owner} must be one of {list(choices)}, got {value!r}")


def check_optional_int(owner: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{owner} must be None or an int, got {type(value).__name__} ({value!r})")


def check_bool(owner: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner} must be a bool, got {type(value).__name__} ({value!r})")
