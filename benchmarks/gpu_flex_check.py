"""GPU check of the engine's flex decode attention (inference/attention.row_length_attention, compiled and autotuned as
the engine runs it) against masked SDPA in fp32, at the SmolLM2 decode shape: 768 rows of random lengths up to 2,048
slots, some rows ended. Prints the largest difference over the live rows and whether the ended rows are zero; once
with the query heads of a K/V head as rows of that head (q_rows = 3, the engine's since 2026-12-04) and once as
grouped heads (q_rows = 1), each timed with CUDA events against the K/V it reads (bytes / time, to set against the
device's copy bandwidth). Then the flex engine in a thread named like regeneration's (compile, autotune and graph
capture off the main thread, as `data.regenerate` runs them): it must keep its flex step (no fallback) and give the
masked engine's tokens on most requests. `PYTHONPATH=src python3 benchmarks/gpu_flex_check.py`"""

import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_train.inference.attention import RowLengthMask, row_length_attention


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    b, H, Hkv, d, L = 768, 9, 3, 64, 2048
    q = torch.randn(b, H, 1, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, Hkv, L, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, Hkv, L, d, device=dev, dtype=torch.bfloat16)
    ends = torch.randint(0, L, (b + 1,), device=dev)
    ends[:8] = torch.tensor([0, 1, 126, 127, 128, 129, 2046, 2047])
    done = torch.rand(b + 1, device=dev) < 0.1
    mask = (torch.arange(L, device=dev)[None] <= ends[:b, None])[:, None, None]
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(H // Hkv, 1),
                                         v.float().repeat_interleave(H // Hkv, 1), attn_mask=mask,
                                         scale=d ** -0.5).transpose(1, 2)
    live = ~done[:b]
    kv_bytes = 2 * Hkv * d * k.element_size() * int((ends[:b][live] + 1).sum())   # K and V up to each live row's end
    for q_rows in (H // Hkv, 1):
        block_mask = RowLengthMask(ends, done, L, q_rows=q_rows).block_mask(b)
        out, _ = row_length_attention(None, q, k, v, block_mask, scaling=d ** -0.5)   # [b, 1, H, d]
        err = (out.float() - ref)[live].abs().max().item()
        for _ in range(3):
            row_length_attention(None, q, k, v, block_mask, scaling=d ** -0.5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            row_length_attention(None, q, k, v, block_mask, scaling=d ** -0.5)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 50
        print(f"q_rows={q_rows}: flex vs fp32 masked SDPA, {int(live.sum())} live rows: max abs diff {err:.2e} (one "
              f"bf16 rounding step at the outputs' magnitude, up to ~4 for a row of one slot, is 1.6e-2); ended rows "
              f"all zero: {bool((out[~live] == 0).all())}; {ms:.3f} ms a call, {kv_bytes / ms / 1e9:.2f} TB/s of "
              f"K/V read")
        assert err < 2e-2


def engine_in_a_thread() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_profile import chat_like_requests, smollm2_llama

    from dflash_train.generation.engine import Engine

    hf = smollm2_llama()
    got: dict[str, dict] = {}

    def run(name: str, attention: str | None) -> None:
        engine = Engine(hf, 256, 1024, decode_attention=attention)
        out = {}
        stats = engine.run(chat_like_requests(768, 3, median_prompt=110, sigma=1.0, max_prompt=700, pool=2048),
                           lambda r, t: out.__setitem__(r.key, t))
        got[name] = dict(out=out, flex=engine.flex, tok_s=stats.generated_tokens / stats.seconds)

    for name, attention in (("masked", "mask"), ("flex", None)):
        t = threading.Thread(target=run, args=(name, attention), name="dflash-regenerate0")
        t.start()
        t.join()
    same = sum(got["flex"]["out"][k] == v for k, v in got["masked"]["out"].items()) / len(got["masked"]["out"])
    print(f"engine in a worker thread, 256 rows: flex kept: {got['flex']['flex']}; tokens/s masked "
          f"{got['masked']['tok_s']:,.0f} (first run, compiles included), flex {got['flex']['tok_s']:,.0f}; same "
          f"tokens as masked on {same:.0%} of the requests (random weights: near-ties)")
    assert got["flex"]["flex"]


if __name__ == "__main__":
    with torch.no_grad():
        main()
        engine_in_a_thread()
