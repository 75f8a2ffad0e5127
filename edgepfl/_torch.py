"""torch for the core's model code, or a stand-in that names the missing extra when used.

A method module declares its options, sharing rules and head kinds next to the
``nn.Module`` classes it trains. A device without torch (the head tier installs
``edgepfl[agent]``) still needs those declarations — ``edgepfl methods``, validating a
config — so method and model modules import torch from here. Where torch is installed
these are the real modules. Where it is not, any use — instantiating a module class,
calling ``torch.zeros`` — raises ``ModuleNotFoundError`` naming the extra to install,
while defining classes on ``nn.Module`` and reading declarations keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

MISSING = "this needs torch, which is not installed here: pip install 'edgepfl[train]'"


class _Unavailable:
    """Any torch attribute where torch is absent: a valid base class that cannot be used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ModuleNotFoundError(MISSING, name="torch")


class _MissingModule:
    """``torch`` / ``torch.nn`` / ``torch.nn.functional`` where torch is absent."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in _DECORATORS:  # ``@torch.no_grad()`` runs at class definition time
            return lambda *args, **kwargs: (lambda fn: fn)
        return _Unavailable


_DECORATORS = frozenset({"no_grad", "enable_grad", "inference_mode"})


if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
    from torch import nn

    HAVE_TORCH: bool
else:
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn

        HAVE_TORCH = True
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        torch = nn = F = _MissingModule()
        HAVE_TORCH = False

__all__ = ["F", "HAVE_TORCH", "MISSING", "nn", "torch"]
