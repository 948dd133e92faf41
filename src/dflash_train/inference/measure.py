"""Measured acceptance at the end of a training run: the evaluator's harness on prompts the run never trained on.

  train (pipeline or --single) -> drafter/ -> speculative decoding vs plain decoding on train.final_eval_prompts
    prompts (data.eval_prompts: the run's held-out conversations, the bundled other-source `yardstick` set, or a
    prompt file) -> <out_dir>/eval_final/ (eval.json, eval.png), a `measured` record in metrics.jsonl, and one log
    line with the measured tau next to the validation and training estimates.

Training's estimates (acc@k on the training rows, and on the held-out validation rows) are estimates; the tau a
drafter reaches in decoding is the figure that matters, so every run ends with it. Synthetic data has no chat
prompts: the held-out synthetic documents' first tokens serve as prompts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import Config
from ..errors import UserError

log = logging.getLogger("dflash_train")
SYNTHETIC_PROMPT_TOKENS = 16  # synthetic data: a prompt is the first tokens of a held-out document
MEASURED_DIR = "eval_final"


def eval_prompt_ids(cfg: Config, tokenizer, n: int, spec: str | None = None,
                    max_prompt_tokens: int | None = None) -> tuple[list[list[int]], list, str]:
    """(token ids, Prompt records, description) of up to n prompts named by `spec` (default data.eval_prompts):
    'heldout' = the run's held-out conversations (synthetic data: held-out documents' first tokens), 'yardstick'
    or a file = read_prompt_file. Prompts longer than max_prompt_tokens are left out."""
    from .prompts import Prompt, heldout_prompts, read_prompt_file, tokenize_prompts

    spec = spec or cfg.data.eval_prompts
    if spec == "heldout" and cfg.data.heldout_fraction <= 0:
        if cfg.data.source == "synthetic":
            return [], [], "no held-out synthetic documents (data.heldout_fraction=0)"
        log.warning("data.eval_prompts=heldout but the run holds nothing out (data.heldout_fraction=0): measuring "
                    "on the bundled yardstick prompts instead")
        spec = "yardstick"
    if spec == "heldout" and cfg.data.source == "synthetic":
        from ..data.dataset import load_dataset

        split = load_dataset(cfg.data, None, seed=cfg.train.seed)
        prompts = [Prompt("ids", s.input_ids[:SYNTHETIC_PROMPT_TOKENS]) for s in split.heldout
                   if len(s.input_ids) > SYNTHETIC_PROMPT_TOKENS]
        what = "held-out synthetic documents"
    elif spec == "heldout":
        prompts = heldout_prompts(cfg.data, tokenizer, 4 * n, cfg.train.seed)  # 4n: the length limit drops some
        what = f"held-out conversations of {cfg.data.source}"
    else:
        prompts = read_prompt_file(spec)
        what = "the bundled yardstick prompts" if spec == "yardstick" else f"prompts of {spec}"
    ids = tokenize_prompts(prompts, tokenizer)
    keep = [i for i, p in enumerate(ids) if p and (max_prompt_tokens is None or len(p) <= max_prompt_tokens)][:n]
    if not keep and spec == "heldout" and cfg.data.source == "synthetic":
        return [], [], "no held-out synthetic documents long enough to prompt with"
    if not keep:
        raise UserError(f"data.eval_prompts={spec!r} gave no usable prompt (none at most {max_prompt_tokens} tokens); "
                        "point it at another prompt file.")
    return [ids[i] for i in keep], [prompts[i] for i in keep], what


def measure_acceptance(cfg: Config, drafter_dir: str | Path, device, result=None, spec: str | None = None,
                       n: int | None = None, new_tokens: int | None = None, out_name: str = MEASURED_DIR,
                       timed: int | None = None):
    """Speculative decoding with the drafter in drafter_dir on up to n (train.final_eval_prompts) prompts of
    new_tokens (train.final_eval_new_tokens) each -> the
    EvalReport (also written to <out_dir>/<out_name>/), or None when there is nothing to prompt with (synthetic
    data without held-out documents). result: the TrainResult, whose estimates join the log line and the
    metrics.jsonl record. timed: plain decoding on this many of the prompts (evaluate; None: all)."""
    from ..models.checkpoint import load_drafter
    from ..models.target import load_target, load_tokenizer
    from .benchmark import evaluate, stop_token_ids
    from .report import tau_text, verdict_text, write_report

    n, new_tokens = n or cfg.train.final_eval_prompts, new_tokens or cfg.train.final_eval_new_tokens
    synthetic = cfg.data.source == "synthetic" and (spec or cfg.data.eval_prompts) == "heldout"
    tokenizer = None if synthetic else load_tokenizer(cfg.model.target)
    drafter = load_drafter(drafter_dir, device)
    target = load_target(cfg.model.target, drafter.config.target_layer_ids, device=device, truncate=False)
    context = target.info.max_position_embeddings - new_tokens - drafter.config.block_size
    ids, prompts, what = eval_prompt_ids(cfg, tokenizer, n, spec, max_prompt_tokens=context)
    if not ids:
        log.warning(f"measured acceptance skipped: {what}")
        return None
    log.info(f"measuring acceptance: speculative decoding on {len(ids)} {what} x {new_tokens} new tokens")
    report = evaluate(target, drafter, ids, new_tokens, stop_ids=stop_token_ids(target.hf, tokenizer),
                      categories=[p.category for p in prompts], ids=[p.id for p in prompts], timed=timed)
    out_dir = Path(cfg.run.out_dir)
    write_report(report, out_dir / out_name)
    s = report.summary()
    rec = {"split": "measured", "step": result.steps if result is not None else None, "prompts": what,
           "num_prompts": len(ids), "new_tokens": new_tokens, "mean_tau": s["mean_tau"],
           "mean_tau_se": s["mean_tau_se"], "speedup": s["speedup"], "verdict": verdict_text(s)}
    estimates = []
    if result is not None and result.best:
        rec["val_tau_est"] = result.best["value"]
        estimates.append(f"validation estimate {result.best['value']:.2f} (step {result.best['step']})")
    if result is not None and result.history:
        rec["train_tau_est"] = result.history[-1]["tau_est"]
        estimates.append(f"training estimate {result.history[-1]['tau_est']:.2f}")
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    log.info(f"measured tau {tau_text(s)} on {len(ids)} {what} (speedup {s['speedup'] or 0:.2f}x, lossless "
             f"{verdict_text(s)}){'; ' + ', '.join(estimates) if estimates else ''}; report in {out_dir / out_name}")
    return report
