"""What every check raises, and how its message is put together."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union


class ContractError(AssertionError):
    """A component broke its contract. The message names the check, its seed and step, the operation
    that showed the problem, what was seen, the rule broken and the method most likely at fault."""


@dataclass(frozen=True)
class Where:
    """Where a check is: the component and settings it checks, the seed of its random stream, the step
    (or operation number) it is at. ``fail`` turns an observation into a ContractError saying all of it."""

    component: str
    seed: Union[int, str]
    settings: str = ""
    step: Optional[Union[int, str]] = None
    step_name: str = "step"

    def at(self, step: Union[int, str], step_name: Optional[str] = None) -> "Where":
        return replace(self, step=step, step_name=step_name or self.step_name)

    def describe(self) -> str:
        text = self.component + (f" ({self.settings})" if self.settings else "") + f", seed {self.seed}"
        return text if self.step is None else f"{text}, {self.step_name} {self.step}"

    def fail(self, operation: str, seen: str, rule: str, suspect: str) -> ContractError:
        """``seen``: what the check observed; ``rule``: the contract's rule it breaks; ``suspect``: the
        method most likely at fault (``"the scheduler's choose_victim()"``)."""
        return ContractError(f"{self.describe()}, in {operation}: {seen}. Rule broken: {rule}. Most likely at "
                             f"fault: {suspect}")
