"""Foundation check on the GPU: the single-device trainer in bf16 with flex attention, compiled step
(eager / default / reduce-overhead), on a random-init Qwen3-shaped target, plus the same compiled step in a plain
worker thread. Prints tokens/s per mode.  Run: PYTHONPATH=src python3 benchmarks/gpu_foundation_check.py"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
import traceback

import torch

from dflash_train.config import load_config
from dflash_train.training.trainer import train_single_device


def make_target(path: str, layers=8, hidden=1024):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
                      vocab_size=32000, max_position_embeddings=8192, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def run(mode: str, target: str, steps: int, in_thread: bool):
    cfg = load_config("tiny_cpu", [f"model.target={target}", f"run.out_dir=/tmp/fcheck_{mode}_{in_thread}",
                                   "run.overwrite=true", "model.block_size=16", "model.num_draft_layers=2",
                                   "model.num_feature_layers=3", "train.token_budget=2048",
                                   "train.num_anchors=128", f"train.max_steps={steps}", "train.log_every=10",
                                   f"train.compile={mode}", "train.attention=flex", "train.dtype=bf16",
                                   "pipeline.drafter_devices=[cuda:0]", "pipeline.target_devices=[cuda:0]",
                                   "data.synthetic_samples=2000"])
    box = {}

    def body():
        try:
            t0 = time.perf_counter()
            box["res"] = train_single_device(cfg)
            box["time"] = time.perf_counter() - t0
        except BaseException:  # noqa: BLE001
            box["err"] = traceback.format_exc()

    if in_thread:
        th = threading.Thread(target=body, name=f"worker-{mode}")
        th.start()
        th.join()
    else:
        body()
    if "err" in box:
        return {"mode": mode, "thread": in_thread, "ok": False, "err": box["err"][-1500:]}
    h = box["res"].history
    late = [r["tokens_per_s"] for r in h[-3:]]
    return {"mode": mode, "thread": in_thread, "ok": True, "tok_s": sum(late) / len(late),
            "loss": h[-1]["loss"], "acc1": h[-1]["acc"][0], "total_s": box["time"]}


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    target = make_target(tempfile.mkdtemp())
    rows = []
    for mode, thread in [tuple(x.split(":")) for x in (sys.argv[1:] or ["eager:0", "default:0", "reduce-overhead:0", "reduce-overhead:1"])]:
        thread = thread == "1"
        r = run(mode, target, 60, thread)
        rows.append(r)
        print(r, flush=True)
    print("\nmode             thread  ok    tokens/s   loss   acc@1")
    for r in rows:
        if r["ok"]:
            print(f"{r['mode']:<16} {r['thread']!s:<6}  ok   {r['tok_s']:>9,.0f}  {r['loss']:.3f}  {r['acc1']:.3f}")
        else:
            print(f"{r['mode']:<16} {r['thread']!s:<6}  FAIL {r['err'].splitlines()[-1]}")


if __name__ == "__main__":
    main()
