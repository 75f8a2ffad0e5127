"""Edge agent: the agent loop (:mod:`.agent`), trainer tier (:mod:`.trainer`, torch) and
head tier (:mod:`.head_tier`, onnxruntime + scikit-learn, never torch).

Importing this package does not import torch.
"""

from .agent import Agent, run_agent

__all__ = ["Agent", "run_agent"]
