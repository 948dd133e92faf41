"""CUDA-graph policy for compiled training steps in worker threads; applied once, before any torch.compile.

`reduce-overhead` captures CUDA graphs through CUDAGraph Trees by default. On torch 2.11 the trees keep per-thread
state that a plain `threading.Thread` worker never gets when the trees module was first imported by the main thread,
and a compiled step called from such a worker fails an assertion in the trees' thread-local lookup. With the trees
off, inductor falls back to per-function CUDA graphs, which work in any thread and suit our fixed shapes.
"""

from __future__ import annotations

import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config


def configure_cudagraphs() -> None:
    """Process-wide compile settings for the drafter step; must run before the first torch.compile call.

    - CUDAGraph Trees off (per-function CUDA graphs instead), so compiled steps run in any thread and each
      replica's graph is its own. No switch turns them back on: the failure they cause is shown by
      benchmarks/gpu_pipeline_check.py (case trees-on), which compiles a step of its own with torch's defaults.
    - AOTAutograd donated buffers off. With them, the backward may write into the saved activations it receives;
      under per-function CUDA graphs those are the forward graph's static outputs, and the backward's warm-up and
      capture runs clobber them before the replay reads them: the gradients come out wrong and training stalls,
      with no error. With donated buffers off the step matches eager / `default` exactly
      (benchmarks/gpu_cudagraph_grad_check.py reproduces both; docs/DESIGN.md, docs/dev-log.md section 7).
    """
    inductor_config.triton.cudagraph_trees = False
    functorch_config.donated_buffer = False
