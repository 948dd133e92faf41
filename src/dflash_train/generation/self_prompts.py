"""Prompts the target writes itself (the technique published as Magpie, arXiv 2406.08464): a chat model given its
template's user-turn header and no content writes a user turn of the kind it was trained to answer. A small chat
model left alone writes mostly casual chat, so a share of the rows (data.self_prompt_steered) is steered: it starts
from an opener, the first few words of a request of some kind ("Write a Python script that", "Solve the inequality"; the
bundled prompts/openers.txt or a file of the user's), and the target writes the rest itself.

  chat template on a sentinel user message -> the "pre-query" prefix: the template's tokens before the content
    -> per row: nothing, or an opener (a kind uniformly, then an opener of that kind): pick_openers
    -> sampled continuations (temperature, stop at the end-of-turn token) by the continuous-batching engine
       (generation/engine.py): a row that ends takes the next batch's next row at once, so a batch costs its rows'
       own lengths, not max_new_tokens each
    -> filtered: empty, truncated (no end of turn within max_new_tokens), too short, non-printable, special tokens
       inside, duplicates (normalised text, also of the prompts already in the file)
    -> {"id": "self_<n>", "messages": [{"role": "user", "content": opener + continuation}], "batch": j} JSONL,
       flushed per batch; with steering also "kind" (the opener's, or "free" for a row from the bare prefix)

Reproducible per seed: batch j picks its openers with its own generator seeded from (seed, j), row i of it samples
with its own seed from (seed, j, i) (the engine's sampled tokens depend on that seed only, not on what ran beside
them), and batches are judged and kept in batch order once all their rows are back, so the first k prompts of a
file do not depend on how many were asked for or where a run was resumed.
Resumable: a rerun drops the records of the file's last batch (a crash may have cut them) and samples again from
that batch on. A side file `<out>.meta.json` records the settings (the batch size too: it changes what a batch
draws; the openers by their sha1); a file written with other settings is never silently extended.

data.self_prompts (generation/run_data.py, answer_self_prompts) then has the target answer the prompts like any other
conversation, into a file of their own that training mixes with the regenerated source (data.mix).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import jinja2
import torch

from ..data.conversations import special_token_ids
from ..data.sidecar import check_settings_file
from ..data.sources import Conversation
from ..errors import UserError
from ..inference.benchmark import stop_token_ids
from .engine import Engine, Request

log = logging.getLogger("dflash_train")

SENTINELS = ("XQZSENTINELONE", "JWVSENTINELTWO")  # different first characters: their first tokens differ
TEMPERATURE = 1.0     # data.self_prompts samples at this temperature (Magpie samples at 1.0)
MIN_CHARS = 8         # a kept prompt has at least this many characters (stripped)
MAX_SAMPLED = 4       # sampling gives up after MAX_SAMPLED x the wanted number of rows (a target that writes few
                      # usable prompts must not sample forever)
OPENERS_PATH = Path(__file__).resolve().parent.parent / "prompts" / "openers.txt"  # data.self_prompt_openers=builtin
FREE = "free"         # the kind recorded for a row sampled from the bare prefix
SAMPLER = "engine-row-seed"  # each row sampled by the engine with its own seed (row_seed); recorded in meta.json


@dataclass
class UserTurnTemplate:
    """Where a user turn's content goes in the target's chat template."""
    prefix_ids: list[int]  # the template's tokens before the user's content: what sampling continues from
    prefix_text: str       # the template's text before the content (prefix_ids decode to it, up to whitespace)
    end_id: int            # the special token that closes a user turn (e.g. <|im_end|>, <|eot_id|>)
    gap: str               # the prefix's trailing whitespace that prefix_ids leave to the content's first token


@dataclass
class SelfPromptSettings:
    """What makes two self-prompt files interchangeable (stored in <out>.meta.json)."""
    target: str
    seed: int
    batch_size: int
    max_new_tokens: int
    temperature: float = TEMPERATURE
    min_chars: int = MIN_CHARS
    openers: dict[str, list[str]] = field(default_factory=dict)  # kind -> openers (read_openers); {} = plain Magpie
    steered: float = 0.0   # the share of rows that start from an opener
    sampler: str = SAMPLER  # how rows draw their tokens: a file sampled otherwise is not extended

    @property
    def steering(self) -> bool:
        return bool(self.openers) and self.steered > 0

    def record(self) -> dict:
        """The meta.json form: the openers by their sha1; without steering, plain Magpie's (it writes the same file)."""
        d = dataclasses.asdict(self)
        d.pop("openers")
        d["steered"] = self.steered if self.steering else 0.0
        d["openers_sha1"] = hashlib.sha1(json.dumps(self.openers).encode()).hexdigest() if self.steering else "none"
        return d


@dataclass
class SelfPromptStats:
    kept: int = 0          # in the file after this call
    written: int = 0       # by this call
    sampled: int = 0       # rows sampled by this call
    dropped: Counter = field(default_factory=Counter)  # reason -> rows
    kinds: Counter = field(default_factory=Counter)    # kind -> rows written (with steering only)

    def line(self) -> str:
        dropped = ", ".join(f"{k}={n}" for k, n in sorted(self.dropped.items())) or "none"
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(self.kinds.items()))
        return (f"self-written prompts: {self.written} new from {self.sampled} sampled "
                f"({self.written / max(self.sampled, 1):.0%} kept; dropped: {dropped})"
                f"{f'; new by kind: {kinds}' if kinds else ''}; {self.kept} in the file")


def _render(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=False)


def user_turn_template(tokenizer) -> UserTurnTemplate:
    """The pre-query prefix of the tokenizer's chat template, from two renders of one user message with different
    sentinel contents: the text before the content must be the same in both (it is the prefix), and the prefix's
    tokens are the tokens the two renders share (a tokenizer that merges the header's last space into the content's
    first token leaves that space to the sampled text). The end-of-turn token is the special token that follows the
    content. Anything else is a template that gives no clean prefix: one error."""
    name = getattr(tokenizer, "name_or_path", "") or "the target"
    try:
        texts = [_render(tokenizer, s) for s in SENTINELS]
    except (jinja2.TemplateError, ValueError) as e:  # no template, or one that refuses a lone user message
        raise UserError(f"The chat template of {name!r} cannot render a lone user message ({e}); self-written "
                        "prompts (data.self_prompts) need a chat model's template.") from None
    starts = [t.find(s) for t, s in zip(texts, SENTINELS)]
    if any(i < 0 or t.count(s) != 1 for i, t, s in zip(starts, texts, SENTINELS)):
        raise UserError(f"The chat template of {name!r} does not write a user message's content exactly once, so it "
                        "has no user-turn prefix to sample from; set data.self_prompts=0.")
    prefix = texts[0][:starts[0]]
    suffix = texts[0][starts[0] + len(SENTINELS[0]):]
    if texts[1][:starts[1]] != prefix or texts[1][starts[1] + len(SENTINELS[1]):] != suffix:
        raise UserError(f"The chat template of {name!r} renders a user turn's header differently for different "
                        "contents, so it has no fixed user-turn prefix to sample from; set data.self_prompts=0.")
    encs = [tokenizer(t, add_special_tokens=False, return_offsets_mapping=True) for t in texts]
    ids, offsets = encs[0]["input_ids"], encs[0]["offset_mapping"]
    n = 0
    while n < min(len(ids), len(encs[1]["input_ids"])) and ids[n] == encs[1]["input_ids"][n]:
        n += 1
    covered = offsets[n - 1][1] if n else 0
    if n == 0 or covered > len(prefix) or prefix[covered:].strip():
        raise UserError(f"The tokens of {name!r}'s chat template do not end where a user's content begins (the "
                        "header's text merges into the content's first token), so sampling has no clean prefix; "
                        "set data.self_prompts=0.")
    special = special_token_ids(tokenizer)
    content_end = len(prefix) + len(SENTINELS[0])
    for tok, (a, b) in zip(ids, offsets):  # the first token after the content that is not just whitespace
        if a < content_end or (tok not in special and not texts[0][a:b].strip()):
            continue
        if tok in special:
            return UserTurnTemplate(list(ids[:n]), prefix, int(tok), prefix[covered:])
        break
    raise UserError(f"The chat template of {name!r} does not close a user turn with a special token (after the "
                    f"content it writes {suffix[:24]!r}), so a sampled user turn has no end; self-written prompts "
                    "need a template like ChatML, Llama-3's or Qwen's; set data.self_prompts=0.")


def read_openers(spec: str) -> dict[str, list[str]]:
    """data.self_prompt_openers -> {kind: [opener, ...]} in file order: 'builtin' (OPENERS_PATH), 'none' ({}), or a
    file of `kind<TAB>opener` lines (blank lines skipped). A file that is not so is one error naming the line."""
    if spec == "none":
        return {}
    path = OPENERS_PATH if spec == "builtin" else Path(spec).expanduser()
    fix = ("write one `kind<TAB>opener` line per opener (kind a word other than 'free'), or set "
           "data.self_prompt_openers=builtin")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"The opener file {path} cannot be read ({e.strerror}); {fix}.") from None
    except UnicodeDecodeError:
        raise UserError(f"The opener file {path} is not UTF-8 text; {fix}.") from None
    openers: dict[str, list[str]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        kind, _, opener = line.partition("\t")
        if not re.fullmatch(r"\w[\w-]*", kind) or kind == FREE or not opener.strip() or "\t" in opener:
            raise UserError(f"Line {n} of the opener file {path} reads {line[:40]!r}; {fix}.")
        openers.setdefault(kind, []).append(opener.strip())
    if not openers:
        raise UserError(f"The opener file {path} holds no openers; {fix}.")
    return openers


def pick_openers(openers: dict[str, list[str]], share: float, rows: int,
                 generator: torch.Generator) -> list[tuple[str, str] | None]:
    """Each row's (kind, opener), or None for a row from the bare prefix: steered with probability `share`, then a
    kind uniformly and an opener of that kind uniformly (a kind with many openers gets no more rows than another).
    Three draws per row from the batch's generator, before its sampling; none without steering, so such a batch
    samples exactly as plain Magpie."""
    if not openers or share <= 0:
        return [None] * rows
    kinds = list(openers)
    picks = []
    for steer, k, i in torch.rand(rows, 3, generator=generator, device=generator.device).tolist():
        kind = kinds[int(k * len(kinds))]  # k in [0, 1): an index below len(kinds)
        pool = openers[kind]
        picks.append((kind, pool[int(i * len(pool))]) if steer < share else None)
    return picks


def normalised(text: str) -> str:
    """The duplicate key: casefolded words, punctuation and spacing ignored."""
    return " ".join(re.findall(r"\w+", text.casefold()))


def judge(tokens: list[int], text: str, stop_ids: set[int], special_ids: set[int], min_chars: int) -> str | None:
    """Why a sampled user turn is dropped (None: kept, but for duplicates, which the caller checks).
    tokens: the sampled ids (the stop token last, if any); text: the content, decoded and stripped."""
    if not tokens or tokens[-1] not in stop_ids:
        return "truncated"
    if any(t in special_ids for t in tokens[:-1]):
        return "special_token"  # e.g. the model wrote the next turn's header itself
    if not text:
        return "empty"
    if any(not (c.isprintable() or c in "\n\t") for c in text) or "\ufffd" in text:
        return "non_printable"  # control characters, or bytes that are not UTF-8 text
    if len(text) < min_chars:
        return "too_short"
    return None


def batch_generator(seed: int, batch: int, device) -> torch.Generator:
    """Batch `batch`'s own generator (its openers): the same draws whether or not the run was resumed before it."""
    h = int.from_bytes(hashlib.sha1(f"self_prompts:{seed}:{batch}".encode()).digest()[:8], "big")
    return torch.Generator(device=device).manual_seed(h)


def row_seed(seed: int, batch: int, row: int) -> int:
    """The sampling seed of row `row` of batch `batch`."""
    return int.from_bytes(hashlib.sha1(f"self_prompts:{seed}:{batch}:{row}".encode()).digest()[:8], "big")


class _Either:
    """Set when any of the events is (the engine's `stop`)."""

    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


@dataclass
class _Batch:
    picks: list             # each row's (kind, opener) or None
    heads: list[list[int]]  # each row's opener ids
    rows: list              # each row's sampled tokens, None until it is back
    left: int               # rows not back yet


def _check_settings(out_path: Path, settings: SelfPromptSettings, replace: bool) -> None:
    check_settings_file(out_path, settings.record(), replace, "self-written prompts",
                        "use another run.out_dir, delete the file, or pass run.overwrite=true to start over")


def _resume(out_path: Path, count: int) -> tuple[list[dict], int | None]:
    """The records to keep and the batch to sample next (None: the file is complete and holds `count` already).
    Otherwise every record but the last batch's (which a crash may have cut) is kept, and the file rewritten so."""
    if not out_path.is_file():
        return [], 0
    records, cut = [], False
    for line in out_path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            cut = True  # a line cut by a crash: only the last batch's records can follow it
            break
    if not cut and len(records) >= count:
        return records, None
    if not records:
        out_path.write_text("", encoding="utf-8")
        return [], 0
    last = max(int(r["batch"]) for r in records)
    kept = [r for r in records if int(r["batch"]) < last]
    out_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    return kept, last


@torch.no_grad()
def write_self_prompts(hf, tokenizer, out_path: str | Path, count: int, settings: SelfPromptSettings,
                       replace: bool = False, stop: threading.Event | None = None) -> SelfPromptStats:
    """Sample until out_path holds `count` self-written prompts (or MAX_SAMPLED x count rows were sampled in all);
    appended a batch at a time (in batch order, flushed), resumable. A set `stop` ends sampling at the engine's next
    check; the batches not complete by then are not written (a rerun samples them again)."""
    out_path = Path(out_path)
    tpl = user_turn_template(tokenizer)
    stop_ids = {tpl.end_id, *stop_token_ids(hf, tokenizer)}
    special = special_token_ids(tokenizer)
    _check_settings(out_path, settings, replace)
    kept, batch = _resume(out_path, count)
    stats = SelfPromptStats(kept=len(kept))
    if batch is None:
        return stats
    seen = {normalised(r["messages"][0]["content"]) for r in kept}
    b = settings.batch_size
    last_batch = math.ceil(MAX_SAMPLED * count / b)
    if stats.kept >= count or batch >= last_batch:
        return stats
    device = hf.get_input_embeddings().weight.device
    # the gap first: the opener then tokenizes as the template's content would
    opener_ids = {(kind, o): tokenizer(tpl.gap + o, add_special_tokens=False)["input_ids"]
                  for kind, pool in settings.openers.items() for o in pool} if settings.steering else {}
    longest = max(map(len, opener_ids.values()), default=0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = Engine(hf, b, len(tpl.prefix_ids) + longest + settings.max_new_tokens, stop_ids=sorted(stop_ids),
                    pad_id=pad_id)
    pending: dict[int, _Batch] = {}
    enough = threading.Event()  # the file holds `count`: the batches still out are not needed
    until = _Either(stop, enough)
    with open(out_path, "a", encoding="utf-8") as f:

        def requests() -> Iterator[Request]:
            """Batch after batch, pulled lazily by the engine (up to a batch's worth ahead of its free rows)."""
            for j in range(batch, last_batch):
                if until.is_set():
                    return
                picks = pick_openers(settings.openers, settings.steered, b, batch_generator(settings.seed, j, device))
                heads = [opener_ids[p] if p else [] for p in picks]  # the opener's ids of each row
                pending[j] = _Batch(picks, heads, [None] * b, b)
                for i, head in enumerate(heads):
                    yield Request((j, i), tpl.prefix_ids + head, settings.max_new_tokens, settings.temperature,
                                  seed=row_seed(settings.seed, j, i))

        def keep(j: int, got: _Batch) -> None:
            """Judge batch j's rows (in order: duplicates are against what came before) and append the kept ones."""
            stats.sampled += len(got.rows)
            lines = []
            for pick, head, tokens in zip(got.picks, got.heads, got.rows):
                body = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
                own = tokenizer.decode(body, skip_special_tokens=False).strip()
                text = tokenizer.decode(head + body, skip_special_tokens=False).strip() if head else own
                reason = judge(tokens, text, stop_ids, special, settings.min_chars)
                if reason is None and not own:
                    reason = "empty"  # the turn ended right after its opener
                key = normalised(text)
                if reason is None and key in seen:
                    reason = "duplicate"
                if reason is None and stats.kept >= count:
                    reason = "not_needed"  # the last batch drew more than asked for
                if reason is not None:
                    stats.dropped[reason] += 1
                    continue
                seen.add(key)
                record = {"id": f"self_{stats.kept}", "messages": [{"role": "user", "content": text}], "batch": j}
                if settings.steering:
                    record["kind"] = pick[0] if pick else FREE
                    stats.kinds[record["kind"]] += 1
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                stats.kept += 1
                stats.written += 1
            f.write("".join(lines))
            f.flush()
            if stats.kept >= count:
                enough.set()

        next_batch = batch  # the next batch to judge: batches are kept in order

        def on_done(req: Request, tokens: list[int]) -> None:
            nonlocal next_batch
            j, i = req.key
            pending[j].rows[i] = tokens
            pending[j].left -= 1
            while next_batch in pending and pending[next_batch].left == 0 and not enough.is_set():
                keep(next_batch, pending.pop(next_batch))
                next_batch += 1

        engine.run(requests(), on_done, stop=until)
    log.info(stats.line())
    if stats.kept < count:
        log.warning(f"only {stats.kept} of the {count} self-written prompts asked for passed the filters after "
                    f"{last_batch * b} sampled rows; training uses those")
    return stats


def read_self_prompts(path: str | Path, count: int | None = None) -> list[dict]:
    """The first `count` records of a self-prompt file (all when None)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records if count is None else records[:count]


def self_prompt_items(records: list[dict]) -> Iterator[tuple[str, object, bool]]:
    """Self-prompt records as regeneration items ((id, conversation, regenerate?), generation/regenerate.py): the id
    `self_<n>_0` keys the conversation as `self_<n>` for the train/held-out split (the `<key>_<n>` rule of source
    record ids), and an empty assistant turn marks the reply that is due (the target writes it; it is never shown)."""
    for r in records:
        messages = [r["messages"][0], {"role": "assistant", "content": ""}]
        yield f"{r['id']}_0", Conversation(key=r["id"], messages=messages), True
