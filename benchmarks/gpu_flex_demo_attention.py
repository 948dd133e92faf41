#!/usr/bin/env python3
"""Where the demo drafter's attention time goes: its flex attention alone at the GPU demo's shape, per mask variant.

The compiled demo step's profile (2026-12-06, H100, docs/gpu-runs/2026-12-06-h100-p/profile_drafter_compiled.log)
spends 9.8 of its 26.1 ms in flex attention (forward 0.43 ms, backward 0.79 ms per layer, 8 layers), though the
mask leaves little to compute: ~4 key tiles per query tile with the demo's short documents. This probe times one
layer's attention, forward + backward, on a row packed like the demo's (documents of ~276 tokens, 1,024 anchors of
16, SmolLM2's 9 query / 3 K/V heads of 64), compiled as the step compiles it (the BlockMask built in the graph):

  bounds     training/objective.py's mask as the step uses it since 2026-12-06 (session 27): mask_mod compares each
             key with its block's bounds (the document's first token, the anchor, the block's own keys)
  documents  the mask_mod before it: the key's document (a per-key gather of doc_ids) against the anchor's
  nomask     every visited tile taken whole (a wrong mask: the floor for what mask evaluation can cost)
  tiles64    `bounds` with 64-wide kernel tiles (gpu_flex_compile.py's kernel-option set of that name)
  split      the block's own keys out of flex: flex over the context only, returning its log-sum-exp, the own keys
             as a batched 16 x 16 attention, merged by log-sum-exp (gradients flow through flex's lse)
  dense      not this mask: SDPA (flash) over as many query-key pairs, every query against the same keys (as many
             as the visited tiles give a query tile): what the hardware does with this much attention work
  bwd_w4, bwd_w4s2, bwd_w2, bwd64_w4
             `tiles64` with other backward launch settings (the `bwd_` kernel options): on sm90 flex's backward
             config for heads of 64 is 64 x 128 tiles with 8 warps and 3 stages, and tiles64 keeps those 8 warps for
             its 32 x 64 tiles. w4 / w2: 4 / 2 warps; s2: 2 stages; bwd64_w4: 64 x 64 backward tiles, 4 warps.
             bwd_w4 is what the step runs since 2026-12-07 (backward kernel 0.424 ms against tiles64's 0.761, H100)
  sparse64, sparse64_w4
             `tiles64` on a mask of 64 x 64 tiles instead of 128 x 128 (flex_block_mask's tile): on the demo's row
             5.7 M query-key pairs visited instead of 8.3 M (3.5 M visible) and 479 of its 1,380 visited tiles full
             (64 of 507 at 128), so fewer pairs and fewer mask evaluations, at more tiles to walk; w4: the backward on
             4 warps. Neither compiles on a GPU with torch 2.11 (H200, 2026-12-07: an InductorError building the mask)
  autotune   `bounds` compiled with mode="max-autotune-no-cudagraphs": inductor times flex's candidate configs
             forward and backward and keeps the fastest (its choices are in the AUTOTUNE lines; compiles for
             minutes, so it runs only when named)
Each flex variant builds its BlockMask inside the compiled function from the row's anchors and doc_ids, as the
training step does.

  PYTHONPATH=src python3 benchmarks/gpu_flex_demo_attention.py [VARIANT ...]
  PROBE_MASK_ONLY=1 PYTHONPATH=src python3 benchmarks/gpu_flex_demo_attention.py   # the mask's tile counts at the
      # demo's shape, 128- and 64-wide tiles (any machine: nothing is timed)
  PROBE_CPU=1 PYTHONPATH=src python3 benchmarks/gpu_flex_demo_attention.py   # the CPU's flex template: forward
      # only (no CPU backward), fp32, 64 anchors on a 1,024-token row; `split` needs return_lse, which it lacks

Prints per variant the time per call, forward alone and forward + backward (CUDA events, median of 20 after 3
warm-up calls; the backward is the difference), the same call's time in kernels (profiler records: flex forward,
flex backward, the rest; on 2026-12-07 the event times of one forward kernel ranged 0.32-0.62 ms across variants,
its kernel ~0.09 ms: the host's pace, so compare variants by their kernels), the largest difference from `bounds`'
output and gradients, and the mask's tile counts. Without `bounds` among the variants run, the first one run is
the reference. A variant that fails (a kernel option this torch does not know) prints its error and the next one
runs. A probe: its figures go to docs/BENCHMARKS.md with this command.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

A, B, T, H, HKV, D = 1024, 16, 8192, 9, 3, 64
CPU = os.environ.get("PROBE_CPU") == "1"
if CPU:
    A, T = 64, 1024
MEAN_DOC = 276        # demo-m: 31.96 M tokens in 115,720 conversations
TILE = 128


def demo_row(seed: int = 0):
    """doc_ids [T], loss_mask [T]: documents of log-normal length around MEAN_DOC, the first sixth a prompt."""
    g = torch.Generator().manual_seed(seed)
    doc_ids, mask, d = [], [], 0
    while len(doc_ids) < T:
        n = max(20, int(MEAN_DOC * math.exp(0.7 * torch.randn(1, generator=g).item() - 0.245)))
        p = max(5, n // 6)
        doc_ids += [d] * n
        mask += [False] * p + [True] * (n - p)
        d += 1
    return torch.tensor(doc_ids[:T]), torch.tensor(mask[:T])


def kernel_ms(call, iters: int = 10) -> dict[str, float]:
    """Device time a call spends in kernels, from the profiler's kernel records over `iters` calls: flex's forward,
    flex's backward, and the rest (the mask's construction, the gradients' casts). The CUDA-event times above run at
    the host's pace when a call's kernels take less than its launches (a fused flex forward is ~0.09 ms); these do
    not. CUDA only."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    ms = {"flex fwd": 0.0, "flex bwd": 0.0, "rest": 0.0}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            part = ("flex bwd" if "flex_attention_backward" in e.name else
                    "flex fwd" if "flex_attention" in e.name else "rest")
            ms[part] += e.time_range.elapsed_us() / 1e3 / iters
    return ms


def main(names: list[str]) -> None:
    from gpu_flex_compile import SETS as KERNEL_SETS
    from harness import time_calls
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.data.packing import sample_anchors
    from dflash_train.models.flex import tile_block_mask
    from dflash_train.training.cudagraphs import configure_cudagraphs
    from dflash_train.training.objective import flex_block_mask

    configure_cudagraphs()
    mask_only = os.environ.get("PROBE_MASK_ONLY") == "1"
    dev = torch.device("cpu" if CPU or mask_only else "cuda")
    dtype, grads = (torch.float32, False) if CPU else (torch.bfloat16, True)
    doc_ids, loss_mask = demo_row()
    anchors, _ = sample_anchors(loss_mask, doc_ids, A, torch.Generator().manual_seed(0))
    doc_ids, anchors = doc_ids.to(dev), anchors.to(dev)
    m = flex_block_mask(anchors, doc_ids, B, TILE)
    print(f"row: {int(doc_ids.max()) + 1} documents, {A} anchors; mask tiles: {int(m.partial.sum())} partial, "
          f"{int(m.full.sum())} full, of {m.partial.numel()} ({m.partial.shape[0]} query tiles)", flush=True)
    visible = int((anchors - m.first).sum()) * B + A * B * B   # each block: its context keys, then its own B keys
    for tile in (TILE, 64):
        mt = flex_block_mask(anchors, doc_ids, B, tile)
        part, full = int(mt.partial.sum()), int(mt.full.sum())
        print(f"  {tile}-wide tiles: {part} partial + {full} full visited, {(part + full) * tile * tile / 1e6:.1f} M "
              f"query-key pairs computed for {visible / 1e6:.1f} M visible", flush=True)
    if mask_only:
        return

    def documents_mask(anchors, doc_ids):
        mask = flex_block_mask(anchors, doc_ids, B, TILE)

        def mask_mod(b, h, q_idx, kv_idx):
            anchor = anchors[(q_idx // B).clamp(max=A - 1)]
            ctx = (kv_idx < anchor) & (doc_ids[kv_idx.clamp(max=T - 1)] == doc_ids[anchor])
            own = (kv_idx >= T) & ((kv_idx - T) // B == q_idx // B)
            return ctx | own
        return tile_block_mask(mask.partial, mask.full, mask_mod, (A * B, T + A * B), TILE)

    def nomask(anchors, doc_ids):
        mask = flex_block_mask(anchors, doc_ids, B, TILE)
        return tile_block_mask(torch.zeros_like(mask.partial), mask.partial | mask.full, lambda b, h, q, k: q >= 0,
                               (A * B, T + A * B), TILE)

    def flex(mask_fn, **options):
        return lambda q, k, v: flex_attention(q, k, v, block_mask=mask_fn(anchors, doc_ids), enable_gqa=True,
                                              kernel_options=options or None)

    def split(q, k, v):
        """The block's own keys out of flex: flex over the context keys only (its log-sum-exp returned), the B own
        keys of each block as one batched B x B attention, the two merged by their log-sum-exps: the same
        attention, a quarter fewer flex tiles (the own tile of each query tile), and gradients through flex's lse."""
        mask = flex_block_mask(anchors, doc_ids, B, TILE)
        ctx_tiles = T // TILE                            # T is a multiple of the tile here: own keys start a tile

        def ctx_mod(b, h, q_idx, kv_idx):
            block = (q_idx // B).clamp(max=A - 1)
            return (kv_idx >= mask.first[block]) & (kv_idx < anchors[block])
        ctx_mask = tile_block_mask(mask.partial[:, :ctx_tiles], mask.full[:, :ctx_tiles], ctx_mod, (A * B, T), TILE)
        out_ctx, lse_ctx = flex_attention(q, k[:, :, :T].contiguous(), v[:, :, :T].contiguous(), block_mask=ctx_mask,
                                          enable_gqa=True, return_lse=True)
        groups = H // HKV
        qb = q.reshape(H, A, B, D)
        kb = k[0, :, T:].reshape(HKV, A, B, D).repeat_interleave(groups, 0)
        vb = v[0, :, T:].reshape(HKV, A, B, D).repeat_interleave(groups, 0)
        scores = (qb.float() @ kb.float().transpose(-1, -2)) * D ** -0.5          # [H, A, B, B]
        lse_own = scores.logsumexp(-1)                                             # [H, A, B]
        out_own = (scores - lse_own[..., None]).exp() @ vb.float()                 # [H, A, B, D]
        lse_ctx = lse_ctx.reshape(H, A, B).float()
        top = torch.maximum(lse_ctx, lse_own)
        w_ctx, w_own = (lse_ctx - top).exp(), (lse_own - top).exp()               # no context: w_ctx = 0
        out = (w_ctx[..., None] * out_ctx.reshape(H, A, B, D).float() + w_own[..., None] * out_own) \
            / (w_ctx + w_own)[..., None]
        return out.reshape(1, H, A * B, D).to(q.dtype)

    step_mask = lambda anchors, doc_ids: flex_block_mask(anchors, doc_ids, B, TILE).block_mask()  # noqa: E731
    mask64 = lambda anchors, doc_ids: flex_block_mask(anchors, doc_ids, B, 64).block_mask()  # noqa: E731
    tiles64 = KERNEL_SETS["tiles64"]
    variants = {"bounds": flex(step_mask), "documents": flex(documents_mask), "nomask": flex(nomask),
                "tiles64": flex(step_mask, **tiles64), "split": split,
                "bwd_w4": flex(step_mask, **tiles64, bwd_num_warps=4),
                "bwd_w4s2": flex(step_mask, **tiles64, bwd_num_warps=4, bwd_num_stages=2),
                "bwd_w2": flex(step_mask, **tiles64, bwd_num_warps=2),
                "bwd64_w4": flex(step_mask, **{**tiles64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
                                               "BLOCK_N2": 64}, bwd_num_warps=4),
                "sparse64": flex(mask64, **tiles64),
                "sparse64_w4": flex(mask64, **tiles64, bwd_num_warps=4),
                "autotune": flex(step_mask)}
    compile_modes = {"autotune": "max-autotune-no-cudagraphs"}   # these compile for minutes: run only when named
    visited = int(m.partial.sum() + m.full.sum()) * TILE // m.partial.shape[0]   # keys a query tile visits
    dense_k = torch.randn(1, H, visited, D, device=dev, dtype=dtype, requires_grad=grads)
    dense_v = torch.randn(1, H, visited, D, device=dev, dtype=dtype, requires_grad=grads)
    variants["dense"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, dense_k, dense_v)
    torch.manual_seed(0)
    q = torch.randn(1, H, A * B, D, device=dev, dtype=dtype, requires_grad=grads)
    k = torch.randn(1, HKV, T + A * B, D, device=dev, dtype=dtype, requires_grad=grads)
    v = torch.randn(1, HKV, T + A * B, D, device=dev, dtype=dtype, requires_grad=grads)
    go = torch.randn(1, H, A * B, D, device=dev, dtype=dtype)
    if CPU:
        for name in ["split", "bwd_w4", "bwd_w4s2", "bwd_w2", "bwd64_w4", "sparse64_w4", "autotune"]:  # CUDA only
            variants.pop(name)
    unknown = [n for n in names if n not in variants]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; here: {', '.join(variants)}")
    phase = "fwd + bwd" if grads else "fwd"
    run = names or [n for n in variants if n not in compile_modes]
    ref_name = "bounds" if "bounds" in run else next(n for n in run if n != "dense")
    reference = None
    for name in run:
        fn = torch.compile(variants[name], dynamic=False, fullgraph=True, mode=compile_modes.get(name))

        def call(backward: bool = grads):
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v)
            if backward:
                out.backward(go)
            return out

        try:
            first_s, ms = time_calls(lambda i: call(), dev, warmup=3, iters=20)
            fwd_ms = time_calls(lambda i: call(False), dev, warmup=3, iters=20)[1] if grads else ms
            out = call()
        except Exception as e:  # noqa: BLE001 - a probe: report the variant's failure, go on with the next
            print(f"{name:9s} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        got = None if name == "dense" else [out.detach().float()] + (
            [q.grad.float(), k.grad.float(), v.grad.float()] if grads else [])
        if reference is None and name == ref_name:
            reference = got
        diff = "" if reference is None or got is None else f" max |diff| vs {ref_name} (out, dq, dk, dv): " + \
            ", ".join(f"{(a - b).abs().max().item():.2e}" for a, b in zip(got, reference))
        split_ms = f" (fwd {fwd_ms:.3f}, bwd {ms - fwd_ms:.3f})" if grads else ""
        kernels = "" if dev.type != "cuda" else "; kernels " + ", ".join(
            f"{part} {t:.3f}" for part, t in kernel_ms(call).items()) + " ms"
        print(f"{name:9s} {phase} {ms:.3f} ms a layer{split_ms}{kernels} (first call {first_s:.1f} s){diff}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
