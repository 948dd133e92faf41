"""Does the pipeline's compiled target forward (models/target.FeatureForward, model.target_compile) give the eager
features on a GPU, in a worker thread, without recompiling across document layouts? (CUDA; tests/test_target_compile.py
is the CPU half.)

A small random Qwen3 (6 layers, H=256) on rows of 512 tokens with four document layouts, for fp32 and bf16, sdpa and
flex, and each of: eager + CUDA graph, compile default, compile default + CUDA graph; then max-autotune + CUDA graph
(flex, bf16), and compile default + CUDA graph with each decoder layer compiled (model.target_compile_layers; bf16,
sdpa and flex). Each case runs in a thread named like the pipeline's target worker, under the training's compile policy,
and prints: the largest |compiled - eager| over the layouts, the frames dynamo compiled on the first row and after it
(after it must be 0; recompiling is an error there), whether a returned tensor survives the next row, and the seconds
to build and run the first row.
Run: PYTHONPATH=src python3 benchmarks/gpu_target_compile_check.py
"""

from __future__ import annotations

import tempfile
import threading
import time
import traceback

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.data.packing import Sample, pack_samples
from dflash_train.models.target import FeatureForward, load_target
from dflash_train.training.cudagraphs import configure_cudagraphs

T = 512
LAYOUTS = [(200, 150, 162), (T,), (1, 2, 3, 100, 7, 300), (130, 40)]  # the last two end in padding


def save_tiny_qwen3(path: str) -> str:
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=1024,
                                 tie_word_embeddings=True)).save_pretrained(path)
    return path


def packed(lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    (row,) = pack_samples([Sample(torch.randint(0, 128, (n,), generator=g).tolist(), [True] * n) for n in lengths], T)
    return [x.cuda() for x in (row.input_ids, row.position_ids, row.doc_ids)]


def check(path: str, rows, dtype: torch.dtype, attention: str, compile: str, graphs: bool, layers: bool = False
          ) -> dict:
    target = load_target(path, [1, 3], device="cuda", dtype=dtype, attention=attention)
    eager = [target.features(*r) for r in rows]
    out: dict = {}

    def work():  # what TargetWorker.setup() and loop() do, checked on the way
        try:
            t0, f0 = time.perf_counter(), counters["frames"]["total"]
            forward = FeatureForward(target, T, compile, graphs, layers=layers)
            got = [forward(*rows[0])]
            torch.cuda.synchronize()
            out["first_row_s"] = round(time.perf_counter() - t0, 1)
            f1 = counters["frames"]["total"]
            with torch._dynamo.config.patch(error_on_recompile=True):
                got += [forward(*r) for r in rows[1:]]
            kept = got[0].clone()
            forward(*rows[1])
            torch.cuda.synchronize()
            out["survives_next_row"] = torch.equal(kept, got[0])
            out["frames_first_then_after"] = (f1 - f0, counters["frames"]["total"] - f1)
            out["max_abs_diff"] = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, eager))
        except Exception:  # noqa: BLE001 - printed per case; the other cases still run
            out["error"] = traceback.format_exc()[-2000:]

    thread = threading.Thread(target=work, name="dflash-target0")
    thread.start()
    thread.join()
    return out


def main() -> None:
    configure_cudagraphs()  # the training's compile policy, as train_pipeline applies it at start-up
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = [packed(lens, seed=i) for i, lens in enumerate(LAYOUTS)]
    cases = [(dtype, attention, compile, graphs, False) for dtype in (torch.float32, torch.bfloat16)
             for attention in ("sdpa", "flex")
             for compile, graphs in (("eager", True), ("default", False), ("default", True))]
    cases.append((torch.bfloat16, "flex", "max-autotune-no-cudagraphs", True, False))
    cases += [(torch.bfloat16, attention, "default", True, True) for attention in ("sdpa", "flex")]
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_qwen3(tmp)
        for dtype, attention, compile, graphs, layers in cases:
            torch._dynamo.reset()  # each case compiles from an empty cache, as a fresh run would
            result = check(path, rows, dtype, attention, compile, graphs, layers)
            scope = "each layer" if layers else "forward"
            print(f"{str(dtype):15} {attention:5} compile={compile:27} ({scope:10}) graphs={graphs!s:5} {result}",
                  flush=True)


if __name__ == "__main__":
    main()
