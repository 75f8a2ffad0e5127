"""The encoders' conv trunk: channels-last activations on the CPU, the same function as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgepfl.methods import create_method
from edgepfl.models import ConvTrunk, SmallCNN, build_encoder
from edgepfl.specs import ModelSpec


def trunks() -> dict[str, tuple[nn.Module, ConvTrunk]]:
    """(module to call, its ConvTrunk) of each conv encoder at 1x28x28."""
    out = {}
    for arch in ("cnn", "fedpac_cnn"):
        torch.manual_seed(0)
        enc = build_encoder(ModelSpec(arch=arch, feature_dim=32), (1, 28, 28))
        assert isinstance(enc, SmallCNN)
        out[arch] = (enc, enc.conv)
    torch.manual_seed(0)
    fedrir = create_method("fedrir").build_model(ModelSpec(feature_dim=32), (1, 28, 28), 10)
    convs = [m for m in fedrir.modules() if isinstance(m, ConvTrunk)]
    assert len(convs) == 2, "FedRIR's two extractors (GFE and CSFE) each have a ConvTrunk"
    for i, trunk in enumerate(convs):
        out[f"fedrir-extractor-{i}"] = (trunk, trunk)
    return out


@pytest.mark.parametrize("name", list(trunks()))
def test_conv_trunk_runs_channels_last_after_its_first_layer_and_computes_the_default_layouts_function(name):
    module, trunk = trunks()[name]
    module.train()
    seen = []
    hook = trunk[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    x = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    try:
        got = module(x)
    finally:
        hook.remove()
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    # the same module run as a plain Sequential keeps the default layout: same values, float rounding aside
    plain = nn.Sequential.forward(trunk, x)
    if module is not trunk:
        plain = module.fc(plain)
    assert got.shape == plain.shape
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-5)


def test_a_training_step_through_the_trunk_leaves_weights_and_gradients_in_the_default_layout():
    torch.manual_seed(0)
    enc = SmallCNN(1, 28, 16)
    head = nn.Linear(16, 3)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 3, (8,))
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(head(enc(x)), y).backward()
        opt.step()
    for key, tensor in enc.state_dict().items():
        assert tensor.is_contiguous(), key
    for p in enc.parameters():
        assert p.grad is not None and p.grad.is_contiguous()
    assert not torch.equal(before["conv.0.weight"], enc.state_dict()["conv.0.weight"])
