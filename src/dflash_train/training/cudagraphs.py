"""CUDA-graph policy for compiled training steps in worker threads.

`reduce-overhead` captures CUDA graphs through CUDAGraph Trees by default. On torch 2.11 the trees keep their
per-thread state in a `threading.local` that only the importing (main) thread gets, so a compiled step called from
a plain `threading.Thread` fails an assertion in the trees' thread-local lookup. Newer torch (2.13 here) initialises
that state lazily in any thread. `init_cudagraph_tls()` does the same for the calling thread on older versions, so
every drafter worker can use the trees; call it at the start of each worker thread, before its first compiled call.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


def init_cudagraph_tls() -> bool:
    """Give the calling thread the CUDAGraph Trees thread-local containers if it has none. Returns True if it
    had to (i.e. this torch would otherwise fail in this thread)."""
    import torch._inductor.cudagraph_trees as trees

    local = trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return False
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    return True


def configure_cudagraphs() -> None:
    """Process-wide compile settings for the drafter step; must run before the first torch.compile call.

    - CUDAGraph Trees off (per-function CUDA graphs instead), so compiled steps run in any thread and each
      replica's graph is its own. DFLASH_CUDAGRAPH_TREES=1 leaves them on, only to demonstrate the thread failure
      (benchmarks/gpu_pipeline_check.py); never set it for training.
    - AOTAutograd donated buffers off. With them, the backward may write into the saved activations it receives;
      under per-function CUDA graphs those are the forward graph's static outputs, and the backward's warm-up and
      capture runs clobber them before the replay reads them. Measured on the H200 (torch 2.11, 2-layer drafter,
      40 AdamW steps): trees off + donated buffers on gave a first-step grad norm of 41.7 instead of 48.0 and
      stalled training (acc@1 0.50 vs 0.875 at step 39); donated buffers off matched eager/`default` exactly.
    """
    import os

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.triton.cudagraph_trees = os.environ.get("DFLASH_CUDAGRAPH_TREES") == "1"
    functorch_config.donated_buffer = False
