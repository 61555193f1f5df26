"""Sink-aware KV-cache quantization: packed storage with the attention sinks kept exact.

* :mod:`~sinklab.kvquant.codec` — bit packing and group quantization (pure tensor functions);
* :mod:`~sinklab.kvquant.plan` — the protection plan and sink detection from column mass (pure);
* :mod:`~sinklab.kvquant.layer` — :class:`DynamicQuantizedSinkLayer`, a transformers cache layer;
* :mod:`~sinklab.kvquant.detect` — a prompt scan that names the sink positions;
* :mod:`~sinklab.kvquant.evaluate` — :func:`kv_quant`, what each bit width × protection costs and buys.
"""

from .codec import BITS, QuantizedTensor, dequantize, pack_bits, quantize, unpack_bits
from .layer import DynamicQuantizedSinkLayer, dense_bytes_per_token, quantized_sink_cache
from .plan import PROTECTIONS, Protection, sink_positions

__all__ = ["BITS", "QuantizedTensor", "dequantize", "pack_bits", "quantize", "unpack_bits",
           "DynamicQuantizedSinkLayer", "dense_bytes_per_token", "quantized_sink_cache",
           "PROTECTIONS", "Protection", "sink_positions"]
