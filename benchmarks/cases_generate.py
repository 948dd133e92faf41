"""Batched generation (dataset regeneration): static batches against the continuous-batching engine, and the bound.

Split from cases_end_to_end.py; registers into the same harness registry.
"""

from __future__ import annotations

import math
import time

import torch
from harness import Context, Row, Skip, benchmark, sync, time_calls


@benchmark("generate", "batched greedy generation (dataset regeneration): batches in arrival order over whole caches "
                       "(before) vs windowed attention vs length-sorted pools, with HF's repeat_kv attention and "
                       "with packed GQA, vs continuous batching (generation/engine.py, regenerate now), with every "
                       "reply new_tokens long and with replies of varied lengths; the bytes-read bound")
def bench_generate(ctx: Context):
    """`dflash-train regenerate`'s decoding on random-init weights of the suite's generation shape (SmolLM2-135M on
    the GPU) and log-normal prompt lengths (a long tail, like chat prompts). Every variant generates new_tokens for
    every prompt (no stop tokens: random weights rarely stop) and pays its own cache allocations and graph
    captures, as a regeneration run does. ms = one batch of b prompts on average; tok/s = generated tokens per
    second. "varied replies": prompt j's reply is replies[j] tokens (log-normal, median new_tokens / 2, as if it
    stopped there); a static batch then decodes until its longest reply ends, the engine refills a row as soon as
    its own reply ends (the tokens counted are the replies' own in both)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.generation.regenerate import LOOKAHEAD_BATCHES
    from dflash_train.generation.engine import Engine, Request, batch_size_for
    from dflash_train.inference.baseline import BatchGenerator

    s, dev, g = ctx.suite, ctx.device, ctx.suite.generate
    if not g:
        raise Skip("this suite has no generation shape")
    b, n, new, max_len = g["batch"], g["prompts"], g["new_tokens"], g["max_length"]
    rng = torch.Generator().manual_seed(0)
    lens = (torch.randn(n, generator=rng) + math.log(g["median_prompt"])).exp().round().long()
    lens = lens.clamp(2, max_len - new).tolist()
    prompts = [torch.randint(1, g["target"]["vocab_size"], (k,), generator=rng).tolist() for k in lens]
    replies = (torch.randn(n, generator=rng) * 0.8 + math.log(new / 2)).exp().round().long().clamp(1, new).tolist()

    def model():
        if "generate_hf" not in ctx.cache:
            default = torch.get_default_dtype()
            torch.set_default_dtype(s.dtype)
            try:
                torch.manual_seed(0)
                with torch.device(dev):
                    ctx.cache["generate_hf"] = LlamaForCausalLM(LlamaConfig(**g["target"], attn_implementation="sdpa"))
            finally:
                torch.set_default_dtype(default)
        return ctx.cache["generate_hf"].eval()

    def slots_for(need: int) -> int:  # the batch generator's cache: a power of two from 128 slots up to max_len
        return max(min(1 << max(7, (need - 1).bit_length()), max_len), need)

    def arrival() -> list[list[int]]:
        return [list(range(i, min(i + b, n))) for i in range(0, n, b)]

    def sorted_pools() -> list[list[int]]:  # regenerate's pools: LOOKAHEAD_BATCHES batches sorted by length, cut
        out, pool = [], b * LOOKAHEAD_BATCHES
        for i in range(0, n, pool):
            idx = sorted(range(i, min(i + pool, n)), key=lambda j: lens[j])
            out += [idx[k:k + b] for k in range(0, len(idx), b)]
        return out

    def measure(batches: list[list[int]], windowed: bool, packed: bool = True, lengths: list[int] | None = None):
        lengths = lengths or [new] * n

        def run():
            hf, gens, outs, slots = model(), {}, {}, 0
            if not ctx.cache.get("generate_warm"):  # first use of the process (kernels, allocator) out of any row
                BatchGenerator(hf, b, slots_for(max(map(len, prompts[:b])) + 2)).generate(prompts[:b], 2)
                ctx.cache["generate_warm"] = True
            sync(dev)
            t0 = time.perf_counter()
            for idx in batches:
                batch = [prompts[j] for j in idx]
                steps = max(lengths[j] for j in idx)  # a static batch decodes until its longest reply ends
                need = max(map(len, batch)) + steps
                if windowed:  # one cache, replaced by a larger one only when a batch does not fit (regenerate now)
                    if "one" not in gens or gens["one"].runner.max_len < need:
                        gens.clear()
                        gens["one"] = BatchGenerator(hf, b, slots_for(need), packed_gqa=packed)
                    gen = gens["one"]
                else:  # one cache per size, attention over all of it every step (before)
                    key = slots_for(need)
                    if key not in gens:
                        gens[key] = BatchGenerator(hf, b, key, kv_window=None, packed_gqa=packed)
                    gen = gens[key]
                slots += b * max(map(len, batch))
                outs.update(zip(idx, (o[:lengths[j]] for j, o in zip(idx, gen.generate(batch, steps)))))
            sync(dev)
            wall = time.perf_counter() - t0
            ref = ctx.cache.setdefault("generate_ref", outs)
            same = sum(outs[j] == ref[j][:lengths[j]] for j in range(n)) / n
            return Row("", "", ms=wall / len(batches) * 1e3, tokens_per_s=sum(lengths) / wall,
                       note=f"{n / wall:,.1f} prompts/s; prefill padding {1 - sum(lens) / slots:.0%}; "
                            f"{same:.0%} outputs equal the first variant's",
                       extra={"wall_s": wall, "prompts_per_s": n / wall, "batches": len(batches),
                              "prefill_padding": 1 - sum(lens) / slots, "same_as_first": same})
        return run

    def continuous(lengths: list[int], tag: str):
        """generate/engine.Engine over regenerate's order (sorted pools, flattened), one run for all prompts."""
        def run():
            hf, outs = model(), {}
            order = [j for idx in sorted_pools() for j in idx]
            engine = Engine(hf, b, max_len)
            sync(dev)
            t0 = time.perf_counter()
            stats = engine.run((Request(j, prompts[j], lengths[j]) for j in order),
                               lambda req, toks: outs.__setitem__(req.key, toks))
            sync(dev)
            wall = time.perf_counter() - t0
            ctx.cache[f"engine_{tag}"] = (stats, wall, sum(lengths), hf)
            ref = ctx.cache.get("generate_ref", {})
            same = sum(outs[j] == ref[j][:lengths[j]] for j in ref) / max(1, len(ref))
            old = next((r for r in reversed(ctx.rows) if r.bench == "generate" and r.status == "ok"
                        and r.variant.startswith("sorted pools, windowed, packed GQA")), None)
            vs = f"{sum(lengths) / wall / old.tokens_per_s:.2f}x the sorted-pools row above; " if old else ""
            return Row("", "", ms=wall / (n / b) * 1e3, tokens_per_s=sum(lengths) / wall,
                       note=f"{vs}{stats.generated_tokens / stats.row_steps:.0%} of row-steps produced a token; "
                            f"prefill padding {1 - stats.prefill_tokens / stats.prefill_padded:.0%}; {same:.0%} "
                            f"outputs equal the first variant's",
                       extra={"wall_s": wall, "steps": stats.steps, "row_steps": stats.row_steps,
                              "kv_slots_read": stats.kv_slots_read, "kv_slots_needed": stats.kv_slots_needed,
                              "same_as_first": same})
        return run

    def bound(tag: str):
        """What the memory traffic allows: each step reads the weights once and the KV slots attention reads;
        divided by the device copy bandwidth (matmul bench's row when it ran, else measured here)."""
        def run():
            if f"engine_{tag}" not in ctx.cache:
                raise Skip("needs the continuous batching row of the same run")
            stats, wall, tokens, hf = ctx.cache[f"engine_{tag}"]
            cfg = hf.config
            elem = next(hf.parameters()).element_size()
            kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
                getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * elem
            weights = sum(p.numel() for p in hf.parameters()) * elem
            bw = copy_bandwidth(ctx) * 1e9
            read = stats.kv_slots_read * kv + stats.steps * weights
            own = stats.kv_slots_needed * kv + stats.steps * weights
            at = tokens / (read / bw)
            return Row("", "", tokens_per_s=at,
                       note=f"{read / stats.steps / 1e9:.2f} GB read a step ({kv:,} B KV a slot) at {bw / 1e9:,.0f} "
                            f"GB/s: measured {tokens / wall / at:.0%} of it; reading only each row's own slots: "
                            f"{tokens / (own / bw):,.0f} tok/s",
                       extra={"bytes_read": read, "bytes_own_slots": own, "copy_gb_per_s": bw / 1e9,
                              "bound_own_slots_tokens_per_s": tokens / (own / bw)})
        return run

    def of_record():
        """Issue #16's row of record: the engine as `regenerate` builds it on this device (`--batch-size auto`:
        as many rows as half the free memory holds KV caches of max_length slots for), over record_waves x those
        rows of prompts, record_new_tokens each. The engine runs them twice: the first pass pays its compiles and
        graph captures (the cold figure, in the note), the second is timed."""
        hf = model()
        batch = batch_size_for([hf], max_len) if dev.type == "cuda" else b
        count, want = g["record_waves"] * batch, g["record_new_tokens"]
        picked = [prompts[j % n][: max_len - want] for j in range(count)]
        engine, outs = Engine(hf, batch, max_len), {}
        walls = []
        for _ in range(2):
            sync(dev)
            t0 = time.perf_counter()
            stats = engine.run((Request(j, picked[j], want) for j in range(count)),
                               lambda req, toks: outs.__setitem__(req.key, toks))
            sync(dev)
            walls.append(time.perf_counter() - t0)
        tokens = count * want
        ctx.cache["engine_record"] = (stats, walls[1], tokens, hf)
        return Row("", "", ms=walls[1] / g["record_waves"] * 1e3, tokens_per_s=tokens / walls[1],
                   note=f"{batch} rows (--batch-size auto), {count:,} prompts x {want} new tokens; the first pass "
                        f"(compiles, graph captures) {tokens / walls[0]:,.0f} tok/s in {walls[0]:.1f} s; "
                        f"{stats.generated_tokens / stats.row_steps:.0%} of row-steps produced a token",
                   extra={"batch": batch, "prompts": count, "new_tokens": want, "wall_s": walls[1],
                          "cold_wall_s": walls[0], "cold_tokens_per_s": tokens / walls[0], "steps": stats.steps,
                          "row_steps": stats.row_steps, "kv_slots_read": stats.kv_slots_read,
                          "kv_slots_needed": stats.kv_slots_needed,
                          "every_reply_full": all(len(outs[j]) == want for j in range(count))})

    # The row of record first: a run cut by its budget still measures the goal.
    record = f"auto rows x {g['record_waves']} waves +{g['record_new_tokens']}"
    ctx.variant("generate", "continuous batching at regenerate's own batch (row of record)", record, of_record,
                cost_s=90)
    ctx.variant("generate", "bound: bytes read a step / copy bandwidth (row of record)", record, bound("record"))
    shape = f"{n} prompts b={b} +{new}"
    ctx.variant("generate", "arrival order, whole cache, repeat_kv (before)", shape,
                measure(arrival(), False, packed=False), cost_s=120)
    ctx.variant("generate", "arrival order, windowed, repeat_kv", shape, measure(arrival(), True, packed=False),
                cost_s=60)
    ctx.variant("generate", "sorted pools, windowed, repeat_kv (2nd GPU session)", shape,
                measure(sorted_pools(), True, packed=False), cost_s=60)
    ctx.variant("generate", "sorted pools, windowed, packed GQA (3rd GPU session)", shape,
                measure(sorted_pools(), True), cost_s=60)
    ctx.variant("generate", "continuous batching (regenerate now)", shape, continuous([new] * n, "fixed"), cost_s=60)
    varied = f"{n} prompts b={b} +{sum(replies) / n:.0f} (1..{new}, varied replies)"
    ctx.variant("generate", "sorted pools, windowed, packed GQA, varied replies", varied,
                measure(sorted_pools(), True, lengths=replies), cost_s=60)
    ctx.variant("generate", "continuous batching, varied replies (regenerate now)", varied,
                continuous(replies, "varied"), cost_s=60)
    ctx.variant("generate", "bound: bytes read a step / copy bandwidth (continuous batching, varied replies)", varied,
                bound("varied"))


def copy_bandwidth(ctx: Context) -> float:
    """Device copy GB/s (read + write): the matmul benchmark's row of this run, else measured as it does."""
    row = next((r for r in ctx.rows if r.bench == "matmul" and r.variant == "device copy" and r.status == "ok"), None)
    if row is not None:
        return row.extra["gb_per_s"]
    dev = ctx.device
    src = torch.zeros((2 << 30 if dev.type == "cuda" else 8 << 20) // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    _, ms = time_calls(lambda i: dst.copy_(src), dev, 3, 10)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
