"""Gamma controllers: how many tokens to draft at the next step, and when to stop a draft early.

``fixed`` (an integer), ``agreement`` (the original document's formula, the baseline), ``cost``
(maximise expected tokens/s from measured costs; turns speculation off where it does not pay),
``confidence`` (stop drafting when the draft's own signals predict a rejection) and ``adaptive``
(confidence-based draft lengths, on while drafting measurably pays; ``cost`` without a fitted
model). State is per request (the engine makes a fresh controller for each one), except the step
costs, the long-run acceptance and the drafting speed, which an engine's requests share.
Controllers do not draft, verify or time anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from specdecode.control.adaptive import AdaptiveGamma
from specdecode.control.agreement import AgreementGamma, agreement_gamma
from specdecode.control.base import FixedGamma, GammaController, StepContext, StepRecord, memory_cap
from specdecode.control.confidence import ConfidenceGamma
from specdecode.control.cost import CostGamma
from specdecode.control.estimates import SharedEstimates
from specdecode.control.model_file import ControllerFileError, load_controller_file

GAMMA_POLICIES = ("agreement", "confidence", "cost", "adaptive")


@dataclass
class ControllerFactory:
    """Makes a fresh controller for each request.

    Args:
        make: builds a controller, given the shared estimates.
        shared: the step costs and long-run acceptance all requests' controllers share and learn (None
            for controllers that use none): a request starts out knowing what earlier ones measured.
    """

    make: Callable[[SharedEstimates | None], GammaController]
    shared: SharedEstimates | None = None

    def __call__(self) -> GammaController:
        return self.make(self.shared)

    @property
    def uses_costs(self) -> bool:
        """Whether its controllers weigh step costs (``cost``, ``adaptive``), so that seeding them pays."""
        return self.shared is not None

    def seed_costs(self, verify_s: Sequence[float]) -> None:
        """Starts the shared verification curve from measured seconds of verifying k = 0, 1, ... drafted
        tokens (see ``StepCosts.seed``); what earlier requests taught about drafting is dropped."""
        if self.shared is not None:
            self.shared.costs.seed(verify_s)


def controller_factory(gamma: int | str, gamma_max: int, drafter: str | None = None,
                       signal_names: Sequence[str] = (),
                       controller_file: str | None = None, max_rows: int = 0) -> ControllerFactory:
    """The factory of per-request controllers for a gamma policy.

    The controller file (``confidence`` and ``adaptive``) is read and checked here, once.

    Args:
        gamma: a fixed gamma or a name in GAMMA_POLICIES.
        gamma_max: upper bound of the named controllers.
        drafter: the drafter's name (its model in the controller file).
        signal_names: the drafter's signal names (checked against the model's features).
        controller_file: a file written by ``specdecode fit-controller``; None = the one shipped.
        max_rows: most rows a forward holds when the engine batches sequences (0: one sequence's).

    Raises:
        ControllerFileError: the file is damaged, of another version, or has no fitting model
            (``confidence`` needs one; ``adaptive`` without one for this drafter acts as ``cost``).
    """
    if isinstance(gamma, int):
        return ControllerFactory(lambda _: FixedGamma(gamma))
    if gamma == "agreement":
        return ControllerFactory(lambda _: AgreementGamma(gamma_max=gamma_max))
    if gamma == "cost":
        return ControllerFactory(lambda shared: CostGamma(gamma_max=gamma_max, shared=shared),
                                 SharedEstimates(gamma_max, max_rows))
    if gamma not in GAMMA_POLICIES:
        raise ValueError(f"unknown gamma controller {gamma!r}; expected an integer or one of {GAMMA_POLICIES}")
    if drafter is None:
        raise ValueError(f"gamma controller {gamma!r} needs a drafter")
    models = load_controller_file(controller_file)
    if gamma == "confidence":
        model = models.model_for(drafter, signal_names)
        return ControllerFactory(lambda _: ConfidenceGamma(model, gamma_max=gamma_max))
    model = models.model_for(drafter, signal_names) if drafter in models.entries else None
    return ControllerFactory(lambda shared: AdaptiveGamma(model, gamma_max=gamma_max, shared=shared),
                             SharedEstimates(gamma_max, max_rows))


__all__ = ["GAMMA_POLICIES", "AdaptiveGamma", "AgreementGamma", "ConfidenceGamma", "ControllerFactory",
           "ControllerFileError", "CostGamma",
           "FixedGamma", "GammaController", "StepContext", "StepRecord", "agreement_gamma", "controller_factory",
           "memory_cap"]
