"""One drafter training step (forward + backward), optionally compiled; the optimizer step lives with the caller.

CUDAGraph Trees keep thread-local state that plain `threading.Thread` workers never get, so a step turns them off
right before it compiles (training/cudagraphs.py, configure_cudagraphs; the training entry points call it at start-up
too): `reduce-overhead` then falls back to per-function CUDA graphs, which work in any thread (the same call turns off
AOTAutograd's donated buffers, without which those graphs computed wrong gradients on torch 2.11). Those graphs remember the parameter addresses of the first module they were captured with, so every
replica gets a step function with its own code object (`_fresh_function`), i.e. its own compile cache and graph.

The frozen target embedding and LM head reach the compiled function as arguments. A plain tensor argument is a
CUDA-graph input that reduce-overhead copies into its own static buffer before every replay (2 x 1.2 GB at a 152k
vocabulary and H = 4096: ~2.5 GB of extra memory and ~1 ms of copies per step). They are marked static addresses
instead, as dynamo marks the drafter's parameters: read in place. Each replica's step holds its own tensors on its
own device and its own compiled function, so a graph only ever sees one address per input.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from ..config import TrainConfig
from ..data.packing import decoding_anchors
from ..devices import DTYPES
from ..models.drafter import DFlashDrafter
from .cudagraphs import configure_cudagraphs
from .objective import default_gamma, dflash_loss

# What a step hands back: summed over a log window (metrics.StepWindow) and averaged over replicas at log steps; the
# acceptance ratios (acc@k, tau estimate) are derived from the summed counts only when a line is logged.
METRIC_KEYS = ("loss", "num_labels", "counts")


def _fresh_function(fn, tag: str):
    """A copy of `fn` with its own code object: torch.compile caches (and CUDA-graphs) per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _loss_fn(drafter, embed_w, head_w, feats, input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid,
             block_size, gamma, attention, loss_chunk, autocast_dtype, kd_weight, weighting, dynamic_alpha):
    device_type = feats.device.type
    target_hidden = None
    if kd_weight > 0:  # feats [T, (k+1)*H]: the tapped layers, then the target's final normed hidden state
        tapped = drafter.fc.in_features
        feats, target_hidden = feats[:, :tapped], feats[:, tapped:]
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
        return dflash_loss(drafter, embed_w, head_w, feats, input_ids, position_ids, doc_ids, loss_mask, anchors,
                           anchor_valid, block_size=block_size, gamma=gamma, attention=attention,
                           loss_chunk=loss_chunk, target_hidden=target_hidden, kd_weight=kd_weight,
                           weighting=weighting, dynamic_alpha=dynamic_alpha)


class DrafterStep:
    """Forward + backward of one packed row on one replica. Gradients land in drafter.parameters().grad."""

    def __init__(self, drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, cfg: TrainConfig,
                 device: torch.device, tag: str = "0", backend: str | None = None):
        """backend: a torch.compile backend overriding the compile mode's inductor (tests and the CPU benchmark
        smoke use 'aot_eager': the same dynamo + autograd tracing, no code generation); ignored when eager.
        cfg: resolved (devices.resolve_config): its compile, attention and dtype are concrete, not "auto"."""
        if "auto" in (cfg.compile, cfg.attention, cfg.dtype):
            raise ValueError("DrafterStep needs a resolved TrainConfig (devices.resolve_config decides each 'auto' "
                             f"once per run); got compile={cfg.compile}, attention={cfg.attention}, dtype={cfg.dtype}")
        self.drafter, self.device = drafter, device
        # Frozen target tensors, in the compute dtype, on this replica's device; never trained.
        self.dtype = DTYPES[cfg.dtype]
        self.embed_w = embed_w.detach().to(device, self.dtype)
        self.head_w = head_w.detach().to(device, self.dtype)
        for w in (self.embed_w, self.head_w):  # static inputs, like parameters: no per-replay copy (docstring)
            torch._dynamo.mark_static_address(w, guard=False)
        self.block_size = drafter.config.block_size
        self.gamma = cfg.gamma or default_gamma(self.block_size)
        # train.position_weights: decay (exp(-(k-1)/gamma)) or dynamic (objective.dynamic_position_weights, from the
        # step's own loss, in the same graph). Validation's loss (evaluate) uses the same weights as training.
        self.position_weights = cfg.position_weights
        self.dynamic_alpha = cfg.dynamic_alpha
        self.attention = cfg.attention
        self.loss_chunk = cfg.loss_chunk
        self.kd_weight = cfg.kd_weight
        # feats [T, feats_width]: k*H tapped, then H more (the target's final hidden state) when distilling
        # (load_target(..., final_hidden=True) appends it), then with train.anchor_sampling=decoding one column of the
        # target's own token probabilities (load_target(..., anchor_weights=True)), which picks the anchors and is
        # cut off before the loss.
        self.anchor_sampling, self.seed = cfg.anchor_sampling, cfg.seed
        self._anchor_rng = None  # torch.Generator on the feats' device, made once, reseeded every step (_anchored)
        self.loss_feats_width = drafter.fc.in_features + (self.head_w.shape[1] if self.kd_weight > 0 else 0)
        self.feats_width = self.loss_feats_width + (self.anchor_sampling == "decoding")
        self.compile_mode = cfg.compile
        # Own, persistent .grad buffers: backward then *accumulates* (copies) into them. A None grad would instead
        # steal the CUDA graph's static output buffer, which a later replay may overwrite (training silently
        # stalled on torch 2.11 with reduce-overhead). Callers zero them in place: zero_grad(set_to_none=False).
        for p in drafter.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._loss = self._compiled(_fresh_function(_loss_fn, tag), backend)
        # Validation's forward (train.validation_graph). own: a forward-only loss with its own code object, so its
        # graph (traced without autograd) never evicts or recompiles the training step's; compiled on first use
        # (callers that validate warm it up first). training: none of its own; evaluate runs the training step's
        # compiled forward with autograd recording and never calls backward, so nothing compiles for validation.
        self._eval_loss = (None if cfg.validation_graph == "training" else
                           self._compiled(_fresh_function(_loss_fn, f"{tag}_eval"), backend))

    def _compiled(self, fn, backend: str | None):
        if self.compile_mode == "eager":
            return fn
        configure_cudagraphs()  # trees off, donated buffers off: before this compile (training/cudagraphs.py)
        if backend is not None:
            return torch.compile(fn, backend=backend, dynamic=False, fullgraph=False)
        return torch.compile(fn, mode=None if self.compile_mode == "default" else self.compile_mode,
                             dynamic=False, fullgraph=False)

    def _loss_feats(self, feats: torch.Tensor) -> torch.Tensor:
        """feats as the target sent them -> what the loss takes (the anchor weights' column cut off)."""
        if feats.shape[1] != self.feats_width:  # a plumbing bug: the target was loaded for another objective
            raise ValueError(f"feats of width {feats.shape[1]} for a step expecting {self.feats_width}: with "
                             f"train.kd_weight={self.kd_weight} and train.anchor_sampling={self.anchor_sampling} load "
                             f"the target with training.run.load_training_target (final_hidden="
                             f"{self.kd_weight > 0}, anchor_weights={self.anchor_sampling == 'decoding'})")
        return feats[:, :self.loss_feats_width]

    def _anchored(self, batch, feats: torch.Tensor):
        """train.anchor_sampling=decoding: the batch with anchors drawn from the target's token probabilities (the
        last column of feats; data/packing.decoding_anchors), seeded by (train.seed, batch index) so that a resumed
        run draws the same ones; uniform: the loader's anchors as they are."""
        if self.anchor_sampling != "decoding":
            return batch
        if self._anchor_rng is None:
            self._anchor_rng = torch.Generator(device=feats.device)
        self._anchor_rng.manual_seed((self.seed * 1_000_003 + batch.index + 1) % 2**63)
        anchors, valid = decoding_anchors(batch.loss_mask, batch.doc_ids, feats[:, -1], batch.anchors.shape[0],
                                          self._anchor_rng)
        return dataclasses.replace(batch, anchors=anchors, anchor_valid=valid)

    def _run(self, loss_fn, batch, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        return loss_fn(self.drafter, self.embed_w, self.head_w, feats.to(self.dtype), batch.input_ids,
                       batch.position_ids, batch.doc_ids, batch.loss_mask, batch.anchors, batch.anchor_valid,
                       self.block_size, self.gamma, self.attention, self.loss_chunk, self.dtype, self.kd_weight,
                       self.position_weights, self.dynamic_alpha)

    def __call__(self, batch, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        """batch: TrainBatch on self.device; feats [T, feats_width] (k*H; (k+1)*H when distilling; one more column
        with train.anchor_sampling=decoding). Returns detached metric tensors (no host sync)."""
        loss_feats = self._loss_feats(feats)
        out = self._run(self._loss, self._anchored(batch, feats), loss_feats)
        out["loss"].backward()
        # CUDA-graph outputs live in static buffers overwritten by the next replay: keep private copies.
        return {k: out[k].detach().clone() for k in METRIC_KEYS}

    def evaluate(self, batch, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        """The same loss and metrics without backward, plus each block's acceptance length (`accept_len` [A]):
        weights, .grad buffers and RNG streams are untouched.

        Through the training step's graph, autograd records as in training (dynamo guards on grad mode: under
        no_grad the same function would compile a second graph) and the record is dropped with `out`; the graph's
        static outputs, the activations saved for a backward among them, are overwritten by the next replay, and
        no backward is pending here (validation runs between steps)."""
        feats = self._loss_feats(feats)  # validation scores the anchors it is given, every one of a row's
        if self._eval_loss is None:
            with torch.enable_grad():
                out = self._run(self._loss, batch, feats)
        else:
            with torch.no_grad():
                out = self._run(self._eval_loss, batch, feats)
        return {k: out[k].detach().clone() for k in (*METRIC_KEYS, "accept_len")}
