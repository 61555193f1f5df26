"""How to add a vision-language type: ask the sweep what already holds before teaching sinklab anything.

``python benchmarks/vlm_architectures.py --types TYPE`` builds a tiny random model of an image-text-to-text type from
its default config (``sinklab.testing.vlm_conformance.build``) and runs the causal-LM matrix's columns on it with an
image (docs/architectures.md, "Vision-language models"); its scan cell scans it on a drawn image and a short text
(``sinklab.scan.scan_images``) and compares the decoder's attention maps and the statistics by modality with the
model's own eager weights. This example runs that cell on one type, then checks the image tokens' sink strength
against a float64 loop written here (``python docs/examples/add_vision_language_type.py [TYPE]``). A ``refused`` cell
says what would lift it: a pixel layout in ``sinklab.vision_inputs``, a config size in ``vlm_conformance.OVERRIDES``,
or a rule for where the type's image positions are.
"""

import sys

import torch

from sinklab import vision_inputs
from sinklab.scan import scan_images
from sinklab.testing import vlm_conformance as vc

model_type = sys.argv[1] if len(sys.argv) > 1 else "llava"
built = vc.build(model_type)
cell = vc.cell_scan(built)
print(f"{model_type} scan: {cell.text()}")
assert cell.status == "ok", cell

inputs = vision_inputs.config_inputs(built.model, vc.test_image(), vc.TEXT_IDS)
result = scan_images(built.model, [vc.test_image()], text_ids=vc.TEXT_IDS)
weights = vc.language_attentions(built.model, inputs.batches[0], result.num_layers)
codes = inputs.modality[0][0].tolist()
t = len(codes)
for layer, w in enumerate(weights):  # strength over image keys: the largest column mass among eligible image keys
    a = w[0].double()
    for head in range(a.shape[0]):
        best = -1.0
        for k in range(t):
            seen = [q for q in range(t) if a[head, q, k] > 0]
            if codes[k] == vision_inputs.IMAGE and len(seen) >= max(8, -(-t // 8)):
                best = max(best, sum(float(a[head, q, k]) for q in seen) / len(seen))
        ours = float(result.modality_sink_strength("image")[0, layer, head])
        assert abs(ours - best) < 1e-6, (layer, head, ours, best)
print("image sink strength per layer:", [round(float(x), 4) for x in
                                         result.modality_sink_strength("image")[0].mean(-1)])
print("top sinks:", [(s["position"], s["modality"], s["patch"]) for s in result.top_sinks(0, k=3)])
assert torch.isfinite(result.visual_sink_share()).all()
