"""The parts of one controller's state as ``ControllerCore`` wires them, handed whole to the two
that work over all of them: the decide loop (``decider``) and the read model (``read_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.context import Contexts
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.evidence import Evidence
from specpilot.controller.core.joint import JointSearch
from specpilot.controller.core.overrides import Overrides
from specpilot.controller.core.published import PublishedPolicy


@dataclass(frozen=True)
class CoreParts:
    config: CoreConfig
    engines: EngineRegistry
    classes: ClassTable
    overrides: Overrides
    evidence: Evidence
    joint: JointSearch
    contexts: Contexts
    published: PublishedPolicy
