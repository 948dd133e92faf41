"""`dflash-train eval`: speculative decoding vs plain decoding on the same harness -> tau, speedup, lossless verdict.

Both paths run on the same static-cache target runner (CUDA-graphed on GPU), one prompt at a time, after one
untimed warm-up generation each; times run from prefill to the last token (prefill included, identical in both).
Plain decoding may run on a subset only (`timed`, evenly spread over the prompts; the demo times 16 of each set):
its cost per token hardly depends on the prompt, so the speedup is plain decoding's ms per token over speculative
decoding's, both on that subset. The other prompts need only their tau and the lossless verdict: greedy with a
DFlash drafter they are decoded together, `batch_rows` at a time (inference/batched.py: each row takes the steps
it would take alone), and the verdict of each is the teacher-forced check below with no plain output to compare.
tau: mean acceptance length over a prompt's verification steps, then the mean over prompts (docs/DESIGN.md). Lossless
(greedy only): every token speculative decoding emitted is the target's greedy choice given its prefix, up to
ties within the dtype's rounding (inference/verdict.py); prompts whose two outputs are identical need no check.

Training's estimate on the same outputs (greedy, a DFlashDrafter): the training loop's acc@k metric
(objective.acceptance_metrics: 1 + sum_k prod_{j<=k} cond_acc_j) computed on the target's own greedy continuation of
every prompt, with an anchor at every generated position, by the training objective's one-pass forward. At the
anchors decoding visits, that forward drafts exactly what decoding drafts (tests/test_inference.py), so the
estimate differs from the measured tau only by averaging over every position instead of the visited ones: a large
gap points at the data (the training rows' estimate vs held-out prompts), not at a train/serve mismatch.

Numerics of the lossless verdict (`--dtype`, stated in eval.json and on the console): the two paths compute the
target's logits in different passes: speculative decoding verifies B tokens in one forward (q = B), plain decoding
feeds one token at a time (q = 1). In fp32 they agree to ~1e-6 and the outputs are identical in practice. In bf16
the different kernel shapes and reduction orders can round a near-tie between the top two logits differently, and
the two texts part there; such a prompt is re-scored by one teacher-forced target pass and counts as lossless when
every emitted token is the argmax or within a few bf16 ulps of it (verdict.py says why that bound): the console
then says `yes (20/32 identical, 12 diverge only at bf16 ties)`, and a real decoder error says
`NO: prompt 7 diverges at token 31, margin 2.1`.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..data.progress import progress_bar
from ..errors import UserError
from ..models.drafter import DFlashDrafter, DrafterConfig
from ..models.drafter2 import DFlash2Drafter
from ..models.target import TargetInfo, TargetModel
from ..training.objective import acceptance_metrics, draft_hidden
from ..training.selector import teacher_forced_picks
from .baseline import target_generate
from .batched import decode_batched
from .decoding import GenerationResult
from .drafter_runner import Drafter2Runner, DrafterRunner
from .report import verdict_text
from .speculative import speculative_generate
from .target_runner import TargetRunner
from .verdict import TIE_ULPS, judge_alone, judge_prompt

log = logging.getLogger("dflash_train")

DEFAULT_NUM_PROMPTS = 16
EVAL_BATCH_ROWS = 32  # untimed prompts decoded together (evaluate's batch_rows)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


class ModelMismatchError(UserError):
    """The drafter was trained for a different target than the one given."""


def check_compatible(dcfg: DrafterConfig, info: TargetInfo, drafter_dir: str = "the drafter") -> None:
    """One clear sentence per mismatch, checked on configs alone (before any weights are loaded)."""
    fix = "pass the target it was trained for (--target) or a drafter trained for this target (--drafter)"
    if dcfg.hidden_size != info.hidden_size:
        raise ModelMismatchError(f"Drafter {drafter_dir} has hidden size {dcfg.hidden_size} but the target has "
                                 f"{info.hidden_size}; {fix}.")
    if dcfg.vocab_size != info.vocab_size:
        raise ModelMismatchError(f"Drafter {drafter_dir} has vocabulary size {dcfg.vocab_size} but the target has "
                                 f"{info.vocab_size}; {fix}.")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < info.num_layers]
    if bad:
        raise ModelMismatchError(f"Drafter {drafter_dir} taps target layers {dcfg.target_layer_ids}, but layer(s) "
                                 f"{bad} do not exist in this {info.num_layers}-layer target; {fix}.")
    if dcfg.num_target_layers != info.num_layers:
        raise ModelMismatchError(f"Drafter {drafter_dir} was trained on a {dcfg.num_target_layers}-layer target "
                                 f"but this target has {info.num_layers} layers; {fix}.")
    if not 0 <= dcfg.mask_token_id < info.vocab_size:
        raise ModelMismatchError(f"Drafter {drafter_dir} uses mask token {dcfg.mask_token_id}, outside the "
                                 f"target vocabulary 0..{info.vocab_size - 1}; {fix}.")


@dataclass
class PromptReport:
    prompt_tokens: int
    baseline: list[int]                  # generated tokens, plain decoding ([] when it did not run: timed False)
    speculative: list[int]               # generated tokens, speculative decoding
    accept_lengths: list[int]            # tau per verification step
    baseline_s: float
    speculative_s: float
    first_mismatch: int | None = None    # index of the first differing token (greedy), None if identical
    mismatch_margin: float | None = None  # target's top-1 minus top-2 logit there: ~0 means a numerical tie
    verdict: str | None = None           # greedy: "identical" | "argmax" | "tie" | "wrong" (verdict.py); None: sampling
    tie_tokens: list[int] = field(default_factory=list)    # emitted tokens within rounding of the argmax, not it
    tie_gaps: list[float] = field(default_factory=list)    # top logit minus the emitted token's logit there
    wrong_token: int | None = None       # first generated token neither the target's argmax nor a tie
    wrong_gap: float | None = None       # top logit minus that token's logit
    plain_wrong: bool = False            # the wrong token is plain decoding's (at the first divergence)
    tau_estimate: float | None = None    # training's acc@k estimate on the target's greedy output (module docstring)
    category: str | None = None          # the prompt's category (e.g. the yardstick's "math"), for per-category tau
    id: str | None = None                # the prompt's id in its file, if it has one
    timed: bool = True                   # plain decoding ran on it (evaluate's `timed`)

    @property
    def tau(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None


@dataclass
class EvalReport:
    block_size: int
    temperature: float
    max_new_tokens: int
    device: str
    graphs: bool
    dtype: str = ""                      # the target's (and the drafter's) compute dtype: bf16 | fp32 | ...
    prompts: list[PromptReport] = field(default_factory=list)

    # ------------------------------------------------------------------ aggregates
    @property
    def steps(self) -> list[int]:
        return [a for p in self.prompts for a in p.accept_lengths]

    @property
    def taus(self) -> list[float]:
        """Tau per prompt, leaving out a prompt done at its first token (it has no step)."""
        return [p.tau for p in self.prompts if p.tau is not None]

    @property
    def mean_tau(self) -> float | None:
        taus = self.taus
        return sum(taus) / len(taus) if taus else None

    @property
    def mean_tau_se(self) -> float | None:
        """The standard error of mean_tau over prompts: how far another set of prompts of the same kinds could move
        it (prompts differ far more than two drafters do on one prompt: compare drafters prompt by prompt,
        benchmarks/compare_evals.py). None below two prompts with a step."""
        taus = self.taus
        return statistics.stdev(taus) / len(taus) ** 0.5 if len(taus) > 1 else None

    @property
    def tau_estimate(self) -> float | None:
        """Mean over prompts of training's acc@k estimate on the target's greedy output (None when not computed)."""
        est = [p.tau_estimate for p in self.prompts if p.tau_estimate is not None]
        return sum(est) / len(est) if est else None

    @property
    def tau_by_category(self) -> dict[str, float] | None:
        """Mean tau per prompt category (prompts without a category or a step left out); None without categories."""
        by: dict[str, list[float]] = {}
        for p in self.prompts:
            if p.category is not None and p.tau is not None:
                by.setdefault(p.category, []).append(p.tau)
        return {c: sum(t) / len(t) for c, t in sorted(by.items())} or None

    @property
    def accept_histogram(self) -> list[int]:
        """counts[t - 1] = number of steps with tau == t, t = 1..B."""
        counts = [0] * self.block_size
        for a in self.steps:
            counts[a - 1] += 1
        return counts

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """[k - 1] = fraction of steps whose draft token k (1..B-1) was accepted. 1 + sum = step-weighted tau."""
        steps = self.steps
        return [sum(a - 1 >= k for a in steps) / len(steps) if steps else None for k in range(1, self.block_size)]

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """[k - 1] = P(draft k accepted | drafts 1..k-1 accepted): comparable to training's cond_acc (acc@k)."""
        steps, out = self.steps, []
        for k in range(1, self.block_size):
            reached = sum(a - 1 >= k - 1 for a in steps)
            out.append(sum(a - 1 >= k for a in steps) / reached if reached else None)
        return out

    @staticmethod
    def _rate(prompts: list[PromptReport], attr_tokens: str, attr_s: str) -> tuple[float | None, float | None]:
        """(tokens per second, milliseconds per token) over `prompts`."""
        tokens = sum(len(getattr(p, attr_tokens)) for p in prompts)
        seconds = sum(getattr(p, attr_s) for p in prompts)
        if not tokens or not seconds:
            return None, None
        return tokens / seconds, 1000 * seconds / tokens

    @property
    def lossless(self) -> bool | None:
        """Greedy: no prompt has a wrong token (identical to plain decoding or the argmax at every token, or
        diverging only at ties: verdict.py).
        Sampling: None (the outputs are not comparable token for token)."""
        if self.temperature > 0:
            return None
        return not any(p.verdict == "wrong" for p in self.prompts)

    @property
    def first_wrong(self) -> dict | None:
        """The first prompt with a wrong token: its index, id, the token index and the logit gap there."""
        for i, p in enumerate(self.prompts):
            if p.verdict == "wrong":
                return {"prompt": i, "id": p.id, "token": p.wrong_token, "gap": p.wrong_gap, "plain": p.plain_wrong}
        return None

    def summary(self) -> dict:
        # both timed on the timed prompts only, one prompt at a time (module docstring)
        timed = [p for p in self.prompts if p.timed]
        base_tps, base_ms = self._rate(timed, "baseline", "baseline_s")
        spec_tps, spec_ms = self._rate(timed, "speculative", "speculative_s")
        s = {
            "num_prompts": len(self.prompts), "block_size": self.block_size, "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens, "device": self.device, "dtype": self.dtype,
            "cuda_graphs": self.graphs,
            "mean_tau": self.mean_tau, "mean_tau_se": self.mean_tau_se, "tau_estimate": self.tau_estimate,
            "tau_by_category": self.tau_by_category,
            "steps": len(self.steps),
            "tau_step_weighted": sum(self.steps) / len(self.steps) if self.steps else None,
            "accept_histogram": self.accept_histogram,
            "acceptance_by_position": self.acceptance_by_position,
            "conditional_acceptance": self.conditional_acceptance,
            "baseline_tokens_per_s": base_tps, "speculative_tokens_per_s": spec_tps,
            "baseline_ms_per_token": base_ms, "speculative_ms_per_token": spec_ms,
            "speedup": base_ms / spec_ms if base_ms and spec_ms else None,
            "lossless": self.lossless,
            "timed_prompts": sum(p.timed for p in self.prompts),
            "identical_prompts": sum(p.timed and p.first_mismatch is None for p in self.prompts),
            "argmax_prompts": sum(p.verdict == "argmax" for p in self.prompts),
            "tie_prompts": sum(p.verdict == "tie" for p in self.prompts),
            "wrong_prompts": sum(p.verdict == "wrong" for p in self.prompts),
            "first_wrong": self.first_wrong, "tie_ulps": TIE_ULPS,
        }
        s["verdict"] = verdict_text(s)   # the console's words, also in eval.json
        return s

    def to_dict(self) -> dict:
        return {"summary": self.summary(),
                "prompts": [dict(asdict(p), tau=p.tau) for p in self.prompts]}


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def acc_estimate(target: TargetModel, drafter: DFlashDrafter, prompt: list[int], continuation: list[int],
                 block_size: int) -> float | None:
    """Training's expected-acceptance estimate on prompt + continuation: an anchor at every position a >= len(prompt)
    whose next token is generated too, acc@k from one forward of the training objective. None if no anchor fits."""
    seq = prompt + continuation
    T, P = len(seq), len(prompt)
    if T - 1 <= P:
        return None
    dev = target.device
    ids, pos = torch.tensor(seq, device=dev), torch.arange(T, device=dev)
    docs = torch.zeros(T, dtype=torch.long, device=dev)
    anchors = torch.arange(P, T - 1, device=dev)
    h, lay = draft_hidden(drafter, target.embed_tokens.weight, target.features(ids, pos, docs), ids, pos, docs,
                          pos >= P, anchors, torch.ones_like(anchors, dtype=torch.bool), block_size=block_size)
    logits = target.lm_head(h)                                              # [A, B-1, V]
    if isinstance(drafter, DFlash2Drafter):  # its drafts are the selector's picks (training/selector.py)
        unary, candidates = logits.topk(drafter.candidate_selector.top_k, dim=-1)
        pred = teacher_forced_picks(drafter.candidate_selector, h, unary, candidates, lay.block_ids, lay.labels)[1]
    else:
        pred = logits.argmax(-1)
    correct = pred == lay.labels
    return float(acceptance_metrics(correct, lay.valid)["tau_est"])


def evaluate(target: TargetModel, drafter, prompts_token_ids: list[list[int]], max_new_tokens: int,
             temperature: float = 0.0, block_size: int | None = None, stop_ids=(), graphs: bool | None = None,
             seed: int = 0, warmup: bool = True, categories: list[str | None] | None = None,
             ids: list[str | None] | None = None, timed: int | None = None,
             batch_rows: int = EVAL_BATCH_ROWS) -> EvalReport:
    """Speculative generation for every prompt, plain generation for `timed` of them (None: every prompt), on one
    harness -> EvalReport.

    target: loaded with truncate=False and the drafter's layer ids. drafter: a DFlashDrafter (run on a private copy
    in the target's dtype) or a ready DraftSource (e.g. a test double). stop_ids: eos ids (see stop_token_ids).
    graphs: CUDA graphs, None = on for CUDA targets. categories, ids: one per prompt (or None), for per-category
    tau and the verdict's words. timed: plain decoding on this many prompts, evenly spread (timed_indices).
    batch_rows: greedy with a DFlash drafter, the prompts not timed are decoded this many at a time
    (inference/batched.py); 1: one at a time, as the timed ones always are."""
    if not prompts_token_ids:
        raise ValueError("no prompts to evaluate")
    plain_on = timed_indices(len(prompts_token_ids), timed)
    for name, tags in (("categories", categories), ("ids", ids)):
        if tags is not None and len(tags) != len(prompts_token_ids):
            raise ValueError(f"{len(tags)} {name} for {len(prompts_token_ids)} prompts")
    if len(target.hf.model.layers) != target.info.num_layers:
        raise ValueError("evaluate needs the whole target (its logits): load it with load_target(..., truncate=False)")
    if isinstance(drafter, DFlashDrafter) and list(drafter.config.target_layer_ids) != target.layer_ids:
        raise ModelMismatchError(f"The drafter reads target layers {drafter.config.target_layer_ids} but the target "
                                 f"taps {target.layer_ids}; load the target with the drafter's target_layer_ids.")
    B = block_size or (drafter.config.block_size if isinstance(drafter, DFlashDrafter) else drafter.block_size)
    max_len = max(len(p) for p in prompts_token_ids) + max_new_tokens + B
    t_run = TargetRunner.for_target(target, max_len, step_lens=(1, B), graphs=graphs)
    if isinstance(drafter, DFlashDrafter):
        runner = Drafter2Runner if isinstance(drafter, DFlash2Drafter) else DrafterRunner
        d_run = runner(drafter, target, max_len, B, graphs)
    else:
        d_run = drafter
    gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    dtype = target.embed_tokens.weight.dtype
    report = EvalReport(B, temperature, max_new_tokens, str(target.device), t_run.graphs,
                        DTYPE_NAMES.get(dtype, str(dtype)))
    together = _decode_untimed_together(target, drafter, prompts_token_ids, plain_on, max_new_tokens, temperature,
                                        B, stop_ids, graphs, batch_rows)
    if warmup:  # first calls pay for allocator growth and kernel selection: keep them out of the timings
        target_generate(t_run, prompts_token_ids[0], min(max_new_tokens, 2 * B), temperature, stop_ids, gen)
        speculative_generate(t_run, d_run, prompts_token_ids[0], min(max_new_tokens, 2 * B), temperature,
                             stop_ids, gen)
    bar = progress_bar(prompts_token_ids, desc="evaluating", unit="prompt", leave=False)  # lines off a TTY
    for i, prompt in enumerate(bar):
        base = (target_generate(t_run, prompt, max_new_tokens, temperature, stop_ids, gen) if i in plain_on
                else None)
        spec = (GenerationResult(together[i][0], 0.0, together[i][1]) if i in together  # decoded with others
                else speculative_generate(t_run, d_run, prompt, max_new_tokens, temperature, stop_ids, gen))
        rep = PromptReport(len(prompt), base.tokens if base else [], spec.tokens, spec.accept_lengths,
                           base.seconds if base else 0.0, spec.seconds,
                           category=categories[i] if categories is not None else None,
                           id=ids[i] if ids is not None else None, timed=base is not None)
        if temperature <= 0:
            if base is not None:
                rep.first_mismatch = _first_mismatch(base.tokens, spec.tokens)
                v = judge_prompt(target.hf, prompt, base.tokens, spec.tokens, rep.first_mismatch)
            else:
                v = judge_alone(target.hf, prompt, spec.tokens)
            rep.verdict, rep.tie_tokens, rep.tie_gaps = v.kind, v.ties, v.tie_gaps
            rep.wrong_token, rep.wrong_gap, rep.plain_wrong = v.wrong_token, v.wrong_gap, v.plain_wrong
            rep.mismatch_margin = v.mismatch_margin
            if isinstance(d_run, DrafterRunner):  # the runner's copy: the drafter as decoding ran it (dtype)
                # the target's greedy output: plain decoding's, or the speculative one it was just checked to be
                greedy = base.tokens if base is not None else spec.tokens
                rep.tau_estimate = acc_estimate(target, d_run.drafter, prompt, greedy, B)
        report.prompts.append(rep)
        log.debug("prompt %d: %d tokens, tau %s, %s plain / %.3fs speculative", i, len(spec.tokens), rep.tau,
                  f"{base.seconds:.3f}s" if base else "no", spec.seconds)
    return report


def _decode_untimed_together(target: TargetModel, drafter, prompts: list[list[int]], timed: set[int],
                             max_new_tokens: int, temperature: float, block_size: int, stop_ids, graphs,
                             rows: int) -> dict[int, tuple[list[int], list[int]]]:
    """{prompt index: (tokens, acceptance lengths)} of the untimed prompts, decoded `rows` at a time
    (inference/batched.py), where that applies: greedy, a DFlash (1 or 2) drafter, rows > 1; else {}. A failure there is a
    warning, and the prompts are decoded one at a time: it costs time, never the measurement."""
    rest = [i for i in range(len(prompts)) if i not in timed]
    if temperature > 0 or rows <= 1 or not rest or not isinstance(drafter, DFlashDrafter):
        return {}
    t0 = time.perf_counter()
    try:
        out = decode_batched(target, drafter, [prompts[i] for i in rest], max_new_tokens, block_size, stop_ids,
                             graphs, rows)
        log.info(f"decoded the {len(rest)} untimed prompts speculatively, up to {rows} at a time, in "
                 f"{time.perf_counter() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001 - one prompt at a time measures the same, only slower
        log.warning(f"decoding the untimed prompts together failed ({type(e).__name__}: {e}); decoding them one at "
                    "a time (--batch-rows 1 does that from the start)")
        return {}
    return dict(zip(rest, out))


def timed_indices(n: int, timed: int | None) -> set[int]:
    """The prompts plain decoding runs on: `timed` of n, evenly spread (every prompt when timed is None or >= n)."""
    if timed is None or timed >= n:
        return set(range(n))
    if timed < 1:
        raise ValueError(f"timed must be at least 1 (got {timed}): the speedup needs plain decoding's time")
    return {i * n // timed for i in range(timed)}


def run_eval_cli(args) -> int:
    from ..models.checkpoint import load_drafter, load_drafter_config
    from ..models.target import load_target, load_tokenizer, target_config_info
    from ..devices import compute_dtype, parse_device
    from .prompts import (check_prompt_lengths, default_prompts, needs_tokenizer, read_prompt_file,
                          tokenize_prompts)
    from .report import format_summary, write_report

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1.")
    if args.block_size is not None and args.block_size < 2:
        raise UserError("--block-size must be at least 2 (the last token plus at least one drafted token).")
    if args.temperature < 0:
        raise UserError("--temperature must be 0 (greedy) or positive.")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError("--num-prompts must be at least 1 (leave it out for every prompt).")
    batch_rows = EVAL_BATCH_ROWS if args.batch_rows is None else args.batch_rows
    if batch_rows < 1:
        raise UserError("--batch-rows must be at least 1 (1 decodes one prompt at a time).")
    if args.timed_prompts is not None and args.timed_prompts < 1:
        raise UserError("--timed-prompts must be at least 1 (the speedup needs plain decoding on some prompts; leave "
                        "it out to time every prompt).")
    out_dir = Path(args.out or "runs/eval")
    if out_dir.is_file():
        raise UserError(f"--out {str(out_dir)!r} is a file; name a directory for eval.json and eval.png.")
    try:  # before minutes of decoding, not after
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {str(out_dir)!r} cannot be created ({e.strerror}); choose a directory you can "
                        "write to.") from None
    dcfg = load_drafter_config(args.drafter)
    info = target_config_info(args.target)
    check_compatible(dcfg, info, args.drafter)
    prompts = read_prompt_file(args.prompts) if args.prompts else None
    tokenizer = load_tokenizer(args.target) if needs_tokenizer(prompts) else None
    if prompts is None:
        prompts = default_prompts(tokenizer, args.num_prompts or DEFAULT_NUM_PROMPTS)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    prompt_ids = tokenize_prompts(prompts, tokenizer)
    check_prompt_lengths(prompt_ids, args.max_new_tokens, info.max_position_embeddings, info.vocab_size)

    device = parse_device(args.device, "--device")
    # The drafter runs in the target's dtype (DrafterRunner), so --dtype sets both.
    target = load_target(args.target, dcfg.target_layer_ids, device=device, dtype=compute_dtype(args.dtype, device),
                         truncate=False)
    drafter = load_drafter(args.drafter, device)
    report = evaluate(target, drafter, prompt_ids, args.max_new_tokens, args.temperature, args.block_size,
                      stop_ids=stop_token_ids(target.hf, tokenizer), categories=[p.category for p in prompts],
                      ids=[p.id for p in prompts], timed=args.timed_prompts, batch_rows=batch_rows)
    write_report(report, out_dir)
    print(format_summary(report))
    print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval.png'}")
    return 0


def stop_token_ids(hf, tokenizer=None) -> list[int]:
    """eos ids from the generation config, the model config and the tokenizer (chat models often have several)."""
    ids: set[int] = set()
    for src in (getattr(hf, "generation_config", None), hf.config, tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return sorted(ids)
