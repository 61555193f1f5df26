"""The variant cases every variant test runs, read from the one table :data:`sinklab.variants.VARIANTS`.

A new row in the table is picked up by every list below that is derived from it (its name alone; and
``OFF_IDENTITY`` when its ``init="off"`` leaves a model's outputs unchanged); the combinations are listed here.
"""

from __future__ import annotations

from sinklab.variants import VARIANTS

SINGLE = [variant.name for variant in VARIANTS]  # every variant alone
# the float64 reference forward, values and gradients (tests/test_variants.py)
REFERENCE = SINGLE + ["sink-logit+gated", "gated+registers", "kv-bias+sink-logit"]
# capture, scan, stream and generate against the reference (tests/test_variants_everywhere.py)
EVERYWHERE = SINGLE + ["kv-bias+sink-logit", "gated+registers", "kv-bias+gated+registers"]
# saved and loaded by path (tests/test_variants.py)
SAVED = SINGLE + ["gated+registers", "kv-bias+sink-logit"]
# init="off" is the identity
OFF_IDENTITY = [variant.name for variant in VARIANTS if variant.off_is_identity] + ["sink-logit+gated"]
# prefill + decode through a DynamicCache == full forwards
KV_CACHE = ["registers", "gated+registers", "kv-bias+gated+registers", "kv-bias", "gated"]
# ViT/DINOv2 against the naive float64 ViT (which writes out registers, gates and the kv slot)
VIT = ["registers", "gated", "gated-headwise", "gated+registers", "kv-bias", "kv-bias+gated+registers"]
