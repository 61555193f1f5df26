"""Are the variant set-ups bit-identical between two versions of sinklab? Dump on one, dump on the other, compare.

Every LM variant set-up (11 specs × init default/off × float64/float32: the variant's parameters, logits,
a SinkCache stream past eviction, the capture's statistics on a left-padded batch) and every ViT/DINOv2 one
(8 specs × init: parameters and outputs) is written to one ``.pt`` file; ``compare`` says which tensors differ
(NaN equal to NaN). Used to check that a refactor of :mod:`sinklab.variants` changes nothing:

    PYTHONPATH=<old>/src python benchmarks/variant_identity.py dump /tmp/before.pt
    PYTHONPATH=src       python benchmarks/variant_identity.py dump /tmp/after.pt
    python benchmarks/variant_identity.py compare /tmp/before.pt /tmp/after.pt
"""

import sys

import torch


def dump(path: str) -> None:
    import sinklab
    from sinklab.variants import apply_variant
    from sinklab.vit import apply_vit_variant
    from sinklab.testing.tiny import V, tiny_llama, tiny_vit

    torch.set_num_threads(1)
    LM = ["sink-logit", "softmax1", "kv-bias", "gated", "gated-headwise", "registers", "sink-logit+gated",
          "softmax1+kv-bias", "kv-bias+gated-headwise", "gated+registers", "sink-logit+kv-bias+gated+registers"]
    VIT = ["registers", "gated", "gated-headwise", "gated+registers", "kv-bias", "kv-bias+gated+registers", "sink-logit",
           "softmax1"]
    out = {}
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    for spec in LM:
        for init in ("default", "off"):
            if init == "off" and "registers" in spec:
                continue
            for dtype in (torch.float64, torch.float32):
                model = tiny_llama().to(dtype)
                torch.manual_seed(7)
                h = apply_variant(model, spec, init=init, **({"sink_init": 1.5} if "sink-logit" in spec and init == "default" else {}))
                key = f"lm/{spec}/{init}/{dtype}"
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if "sinklab" in n:
                            out[f"{key}/param/{n}"] = p.detach().clone()
                            if init == "default":
                                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))).to(p) * 0.3)
                    out[f"{key}/logits"] = model(input_ids=ids).logits
                    with sinklab.AttentionCapture(model) as cap:
                        batch = cap.run(input_ids=ids, attention_mask=torch.tensor([[0, 0] + [1] * 9, [1] * 11]))
                    for name in ("column_mass", "learned_sink_mass", "value_norm_out", "update_norm"):
                        out[f"{key}/capture/{name}"] = getattr(batch, name)
                    with sinklab.StreamSession(model, num_sinks=2, window=4) as s:
                        out[f"{key}/stream"] = torch.cat([s.feed(ids[:1, :7], all_logits=True)[0]] +
                                                         [s.step(ids[:1, i:i + 1]) for i in range(7, 11)])
                h.remove()
    for kind in ("vit", "dinov2"):
        for spec in VIT:
            for init in ("default", "off"):
                model = tiny_vit(kind)
                torch.manual_seed(7)
                h = apply_vit_variant(model, spec, init=init, **({"registers": 2} if "registers" in spec else {}))
                key = f"vit/{kind}/{spec}/{init}"
                x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(2))
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if "sinklab" in n:
                            out[f"{key}/param/{n}"] = p.detach().clone()
                    out[f"{key}/out"] = model(pixel_values=x).last_hidden_state
                h.remove()
    torch.save(out, path)
    print(len(out), "tensors")


def compare(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    if a.keys() != b.keys():
        print("different set-ups:", sorted(set(a) ^ set(b))[:10])
        return 1

    def same(x, y):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():
            return bool(((x == y) | (x.isnan() & y.isnan())).all())
        return torch.equal(x, y)

    bad = [k for k in a if not same(a[k], b[k])]
    print(f"{len({'/'.join(k.split('/')[:4]) for k in a})} set-ups, {len(a)} tensors; {len(bad)} differ", bad[:10])
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"] and len(sys.argv) == 3:
        dump(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
