"""How to add a variant: one ``Variant`` subclass and one entry in ``sinklab.variants.VARIANTS``.

The variant attention, the capture, the stream, the ViT side and the CLI's list of names loop over the table. A
variant that needs a setting of its own adds a field to ``VariantConfig`` (and a case in ``tests/variant_cases.py``);
this one is a new kind of an existing field: ``gate="constant"``, one learned scalar gate σ(g_h) per head, with no
input. It is checked against an independent forward: the plain model with each head's attention output scaled by
σ(g_h) before the output projection (``python docs/examples/add_variant.py``).
"""

import torch
from torch import nn

import sinklab.variants as variants
from sinklab.models import tiny_llama


class ConstantGate(variants.Variant):
    """One learned scalar gate per head, σ(g_h); ``init="off"`` starts at σ(30) = 1 (the identity)."""

    name, fields, off_is_identity = "gated-constant", {"gate": "constant"}, True

    def add_parameters(self, patch, attn, *, heads, kv_heads, head_dim, width, init, sink_start, generator):
        start = 30.0 if init == "off" else 0.0
        patch.add(attn, "sinklab_gate", nn.Parameter(torch.full((heads,), start, device=attn.q_proj.weight.device)))

    def gate(self, module, heads):
        return torch.sigmoid(module.sinklab_gate.float()).view(1, 1, heads, 1)  # [B, Tq, H, 1], broadcast


table = variants.VARIANTS
variants.VARIANTS = (*table, ConstantGate())
try:
    model = tiny_llama(num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    heads = model.config.num_attention_heads
    with torch.no_grad():
        plain = model(ids).logits
        handle = variants.apply_variant(model, variants.VariantConfig(gate="constant"), init="off")
        assert torch.allclose(model(ids).logits, plain, atol=1e-5)  # off is the identity
        g = torch.linspace(-2.0, 2.0, heads)
        for layer in model.model.layers:
            layer.self_attn.sinklab_gate.copy_(g)
        gated = model(ids).logits
        handle.remove()

        # the reference: the plain model, each head's output scaled by σ(g_h) on its way into o_proj
        def scale(module, args):
            x = args[0]
            return (x.unflatten(-1, (heads, -1)) * torch.sigmoid(g)[:, None]).flatten(-2),

        hooks = [layer.self_attn.o_proj.register_forward_pre_hook(scale) for layer in model.model.layers]
        want = model(ids).logits
        for hook in hooks:
            hook.remove()
    assert torch.allclose(gated, want, atol=1e-5), (gated - want).abs().max()
    assert not torch.allclose(gated, plain, atol=1e-3)  # the gate did something
    print(f"gated logits match the reference within {(gated - want).abs().max():.1e}")
finally:
    variants.VARIANTS = table
