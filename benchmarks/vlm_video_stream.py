"""A video streamed frame by frame through a tiny vision-language model under the video memory plan
(``sinklab.vision_stream.VideoMemory``: sinks, the prompt and the first frame pinned, the newest frames): memory
sampled along the way, logits at a few frames past eviction against the float64 reference.

Each frame is procedurally drawn (``testing.vlm_conformance.video_frame``), encoded by the model's own vision tower
and fed as its block of tokens (its image tokens, then a few text ids) through one ``StreamSession``. Memory:

* **RSS** of the process (``psutil``), which includes the allocator's slack and Python's own objects;
* **cache bytes**: the stream's tensors (``SinkCache.state_dict``: every layer's keys and values and the per-row
  bookkeeping), which must not grow after the first eviction.

Reference: a token's state at layer ``l`` depends only on the anchored tokens and the window before it at layer
``l − 1``, so after frame ``n`` the stream's logits equal those of a fresh float64 reference
(``sinklab.testing.reference``) fed the prompt, the pinned first frame and the last ``(L + 1) · K`` frames (the
projected vision features as embeddings, token by token), as ``benchmarks/long_run.py`` argues for text.

    python benchmarks/vlm_video_stream.py [--frames 10000] [--recent 4] [--every 500]
"""

from __future__ import annotations

import argparse
import time

import psutil
import torch
from _common import print_table, run_metadata, write_result


def cache_bytes(session) -> int:
    def walk(tree) -> int:
        if isinstance(tree, torch.Tensor):
            return tree.numel() * tree.element_size()
        if isinstance(tree, dict):
            return sum(walk(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(walk(v) for v in tree)
        return 0

    return walk(session.sink.state_dict())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="llava", help="the tiny vision-language type (1-D rotary, or M-RoPE: "
                        "qwen2_vl …)")
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--recent", type=int, default=4, help="the newest frames kept (K)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--every", type=int, default=500, help="frames between memory samples")
    parser.add_argument("--checks", type=int, nargs="*", default=None, help="frames compared with the reference "
                        "(default: four spread over the run, past eviction)")
    args = parser.parse_args(argv)

    from sinklab.testing import vlm_conformance as vc
    from sinklab.testing.reference import Reference
    from sinklab.vision_stream import stream_video, video_frames

    torch.set_num_threads(1)
    model = vc.build(args.type).model
    layers = int(model.config.get_text_config().num_hidden_layers)
    prompt = [20, 21, 22, 23]
    text = [11, 12]
    checks = args.checks or sorted({args.frames // 10, args.frames // 2, args.frames - 1, 3 * args.recent})
    span = (layers + 1) * args.recent
    # the reference's frames and their decoder embeddings, computed before the stream holds the model
    needed = sorted({0} | {f for c in checks for f in range(max(1, c - span + 1), c + 1)})
    blocks = dict(zip(needed, video_frames(model, [vc.video_frame(i) for i in needed], text)))
    embeds = {i: vc.decoder_embeds(model, b.batches[0]) for i, b in blocks.items()}
    ours: dict[int, torch.Tensor] = {}
    samples = []
    process = psutil.Process()
    start = time.perf_counter()
    frames = (vc.video_frame(i) for i in range(args.frames))
    for step in stream_video(model, frames, prompt_ids=prompt, text_ids=text, num_sinks=args.sinks,
                             recent_frames=args.recent):
        index, logits, session, memory = step  # the last memory and session are read after the loop
        if index in checks:
            ours[index] = logits[0].clone()
        if index % args.every == 0 or index == args.frames - 1:
            samples.append({"frame": index, "tokens": session.tokens_seen, "cache_tokens": session.cache_tokens(),
                            "cache_bytes": cache_bytes(session), "rss_mib": process.memory_info().rss / 2**20,
                            "seconds": time.perf_counter() - start})
    wall = time.perf_counter() - start
    rows = []
    for c in checks:
        fed = [0, *range(max(1, c - span + 1), c + 1)]
        offsets = vc.frame_offsets(model, len(prompt), [blocks[f].batches[0] for f in fed])  # M-RoPE: per frame
        ref = Reference(model, args.sinks, memory.config().window, memory.pinned(), offsets=offsets)
        for t in prompt:
            ref.step(t)
        vc.reference_feed(ref, blocks[0], embeds[0])
        for f in range(max(1, c - span + 1), c + 1):
            expected = vc.reference_feed(ref, blocks[f], embeds[f])
        rel = float((ours[c].double() - expected).abs().max() / expected.abs().max())
        rows.append({"frame": c, "tokens": len(prompt) + (c + 1) * memory.frame_tokens, "max_rel_error": rel,
                     "same_argmax": bool(int(ours[c].argmax()) == int(expected.argmax()))})
    first_full = next(s for s in samples if s["cache_tokens"] == samples[-1]["cache_tokens"])
    after = [s for s in samples if s["frame"] >= first_full["frame"]]
    summary = {"frames": args.frames, "frame_tokens": memory.frame_tokens, "window": memory.config().window,
               "capacity": session.state.capacity,
               "cache_bytes_after_eviction": sorted({s["cache_bytes"] for s in after}),
               "rss_mib_growth_after_eviction": after[-1]["rss_mib"] - after[0]["rss_mib"],
               "frames_per_second": args.frames / wall, "worst_rel_error": max(r["max_rel_error"] for r in rows)}
    print_table(samples, {"frame": "frame", "tokens": "tokens fed", "cache_tokens": "cache tokens",
                          "cache_bytes": "cache bytes", "rss_mib": "RSS MiB", "seconds": "s"}, title="memory")
    print_table(rows, title="against the float64 reference (fresh, over the kept frames)")
    print_table([summary], title="summary")
    data = {"meta": run_metadata(model=f"tiny {args.type} (vlm_conformance.build)", device="cpu", dtype="float32",
                                 wall_seconds=wall, memory="RSS (psutil) and the stream's tensors (SinkCache.state_dict)",
                                 note="a shared, loaded 2-core VM: seconds and RSS are indicative"),
            "summary": summary, "memory": samples, "reference": rows}
    write_result("vlm_video_stream.json" if args.type == "llava" else f"vlm_video_stream_{args.type}.json", data)
    return data


if __name__ == "__main__":
    main()
