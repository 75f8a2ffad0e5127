"""A shared and a personal classifier's scores as one prediction (DualFed, FedPick).

Both founding methods that keep two classifiers infer with their ensemble, and both
offer the same alternative forms, so the forms have one home here:

* ``logits`` — the sum of the raw scores, the papers' (and DualFed's code's) form;
* ``softmax`` — the average of the two predicted distributions, returned as
  ``log((p_shared + p_personal) / 2)``: log-probabilities are valid scores, so the
  argmax and an evaluation's cross-entropy both see the averaged distribution;
* ``personal`` — the personal classifier alone (FedPick's option for label-shift fleets
  that train many local epochs, where the averaged classifier's wider logits outvote it).

The measured effect of each form is in METHODS.md (deviation rows of DualFed and FedPick).
"""

from __future__ import annotations

import math
from typing import Literal

from .._torch import F, torch

EnsembleForm = Literal["logits", "softmax", "personal"]


def ensemble_logits(shared: torch.Tensor, personal: torch.Tensor, form: str) -> torch.Tensor:
    """Class scores (``[batch, classes]``) of the two classifiers' ensemble in ``form``."""
    if form == "logits":
        return shared + personal
    if form == "softmax":
        stacked = torch.stack([F.log_softmax(shared, 1), F.log_softmax(personal, 1)])
        return torch.logsumexp(stacked, 0) - math.log(2.0)
    if form == "personal":
        return personal
    raise ValueError(f"unknown ensemble form {form!r}: one of logits, softmax, personal")
