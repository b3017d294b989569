"""A tunable field of a core config dataclass: its default and the constraints on its value.

The config dataclasses (``CoreConfig``, ``EstimatorConfig``, ``CostPrior``, ``PolicyConfig``)
are where each tunable lives: its default here, its documentation in the docstring under the
field (``specpilot.contract.fielddocs``). The settings layer (``controller/settings.py``) turns every such
field into a setting and enforces these constraints, naming the setting in the message. The core
itself trusts its config: constructing a dataclass checks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

# Key of ``dataclasses.Field.metadata`` under which a tunable's Constraints are kept.
CONSTRAINTS = "specpilot.constraints"


@dataclass(frozen=True)
class Constraints:
    """Bounds of one setting's value; ``at_most`` and ``one_of`` name another setting."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    # A list of positive, strictly increasing integers.
    increasing: bool = False
    # The value must not exceed the named setting's.
    at_most: str | None = None
    # The value must be an element of the named (list) setting.
    one_of: str | None = None


def tunable(default: T, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, increasing: bool = False, at_most: str | None = None,
            one_of: str | None = None) -> T:
    """A dataclass field with ``default`` and the given constraints (see ``Constraints``)."""
    constraints = Constraints(ge, gt, le, increasing, at_most, one_of)
    return field(default=default, metadata={CONSTRAINTS: constraints})
