"""Does a compiled `reduce-overhead` drafter step compute the same gradients as eager? (H200, torch 2.11)

40 AdamW steps of a 2-layer drafter on learnable synthetic data; every 8 steps prints the compiled step's loss,
the eager loss with the same weights, acc@1 and the gradient norm. Environment switches:
  TREES=1   CUDAGraph Trees on (default off, as the product runs)
  DONATE=0  AOTAutograd donated buffers off (the product's setting since training/cudagraphs.py)
  THREAD=1  run the loop in a plain threading.Thread
Run: PYTHONPATH=src [TREES=1] [DONATE=0] python3 benchmarks/gpu_cudagraph_grad_check.py reduce-overhead flex
(docs/dev-log.md section 7 has the figures.) Note: importing dflash_train.training.step already sets donated
buffers off; this script sets them back on unless DONATE=0, to reproduce the bug.
"""
import copy, os, sys

import torch
import torch._functorch.config as fc
import torch._inductor.config as ic

sys.path.insert(0, "src")
from dflash_train.config import load_config
from dflash_train.data.synthetic import synthetic_samples
from dflash_train.data.packing import BatchSchedule
from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.training import step as S
ic.triton.cudagraph_trees = os.environ.get("TREES") == "1"
fc.donated_buffer = os.environ.get("DONATE") != "0"
torch.manual_seed(0)
dev = torch.device(os.environ.get("DEV","cuda"))
cfg = DrafterConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=128, vocab_size=1000, target_layer_ids=[1,2], num_target_layers=4, mask_token_id=999, block_size=16)
base = DFlashDrafter(cfg)
embed = torch.randn(1000, 512, device=dev, dtype=torch.bfloat16)*0.05; head = torch.randn(1000, 512, device=dev, dtype=torch.bfloat16)*0.05
N = 40
batches = [b.to(dev) for b in BatchSchedule(synthetic_samples(800, seed=0), 1024, 64, 0, N + 1)]
fe = torch.randn(1000, 1024, device=dev, dtype=torch.bfloat16)
feats = [fe[b.input_ids] for b in batches]   # features determined by the token: learnable
probe, pfeats = batches[-1], feats[-1]
mode = sys.argv[1]; att = sys.argv[2]
d = copy.deepcopy(base).to(dev)
tc = load_config(None, [f"train.compile={mode}", f"train.attention={att}", "train.dtype=bf16"]).train
step = S.DrafterStep(d, embed, head, tc, dev, tag="x")
opt = torch.optim.AdamW(d.parameters(), lr=3e-3, fused=(dev.type=="cuda"))
def eager_loss(b, f):
    with torch.no_grad():
        return S._loss_fn(d, embed, head, f, b.input_ids, b.position_ids, b.doc_ids, b.loss_mask, b.anchors, b.anchor_valid, step.block_size, step.gamma, step.attention, step.loss_chunk, step.dtype)["loss"].item()
def train():
    for i in range(N):
        before = eager_loss(batches[i], feats[i])
        out = step(batches[i], feats[i])
        gn = torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0).item()
        opt.step(); opt.zero_grad(set_to_none=False)
        if i % 8 == 0 or i == N - 1:
            print(f"{mode} {att} trees={os.environ.get('TREES','0')} step {i}: compiled loss {out['loss'].item():.4f} eager-same-weights {before:.4f} acc1 {out['acc'][0].item():.3f} gnorm {gn:.3f}", flush=True)
import threading, traceback
if os.environ.get("THREAD") == "1":
    def w():
        try: train()
        except Exception: print("THREAD ERR", traceback.format_exc()[-800:], flush=True)
    t = threading.Thread(target=w); t.start(); t.join()
else:
    train()
