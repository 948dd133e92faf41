"""`dflash-train regenerate`: the target rewrites the assistant turns of a chat dataset, so that the drafter trains on
the target's own answers (what it will have to predict when serving).

  conversations (data/sources.py) -> history rendered with the chat template (inference/prompts.py)
    -> a pool of due replies, sorted by prompt length and cut into batches
    -> batched decoding (inference/baseline.BatchGenerator: left padding, static KV cache, CUDA-graphed steps)
    -> {"id": ..., "messages": [...]} JSONL records, appended and flushed after every batch

Throughput: a left-padded batch costs its longest prompt for every row, in the prefill and in every decode step
(each step reads the KV cache of all rows up to that length). Chat prompts have a long tail (a pasted document
among short questions), so batches in arrival order pay for the tail almost every time. Due replies are pooled,
LOOKAHEAD_BATCHES batches at a time, sorted by prompt length and cut into batches: batches of similar lengths (the
long prompts end up together), and a run stopped early has regenerated source records in order up to its last pool.
Records are written in completion order within a pool (readers key on the id). One batch generator is kept and
replaced by a larger one only when a batch does not fit.

Multi-turn conversations are regenerated turn by turn: the history a reply is generated from holds the original
system/user turns and the target's OWN earlier replies (never the original answers), as when it serves. With
`single_turn` each conversation is kept only up to its first assistant turn (one generation per conversation).
A conversation is cut before the first turn whose prompt + max_new_tokens exceeds max_length; one without any
fitting turn, or whose first reply is empty, is dropped (counted in the summary).

Resumable: record ids are `<key>_<n>` (n = the number of earlier source records with the same key: ShareGPT splits
long chats into parts that share one key), and source records whose id is already in the output are skipped. The id
keeps the source's train/held-out split, because the data loader reads the key back from it. A side file
`<out>.meta.json` records the settings; a file written with other settings is never silently extended.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import jinja2
import torch
from tqdm import tqdm

from ..errors import UserError
from .sources import Conversation, DataError, iter_conversations, open_source

log = logging.getLogger("dflash_train")

MIN_CACHE_SLOTS = 128  # the static cache is sized in powers of two from here up to max_length (grown when needed)
MAX_AUTO_BATCH = 768   # the largest batch measured on real data (docs/BENCHMARKS.md section 11: SmolLM2 on an H200)
CPU_BATCH = 8          # `--batch-size auto` on a CPU
LOOKAHEAD_BATCHES = 8  # due replies pooled (in batches) so that each batch can take prompts of similar length


@dataclass
class RegenerateSettings:
    """What makes two regenerations of one source interchangeable (stored in <out>.meta.json)."""
    source: str
    target: str
    max_new_tokens: int
    temperature: float
    single_turn: bool
    max_length: int
    seed: int = 0


@dataclass
class RegenerateStats:
    conversations: int = 0        # written in this call
    already_done: int = 0         # skipped: present in the output before this call
    copied: int = 0               # written unchanged (held-out side of a training run)
    turns: int = 0                # replies generated
    generated_tokens: int = 0
    row_steps: int = 0            # decoding steps x batch rows (dummy rows too): what the generated tokens cost
    seconds: float = 0.0
    dropped: Counter = field(default_factory=Counter)  # reason -> conversations not written

    def add(self, other: "RegenerateStats") -> None:
        """Add another replica's counts (the ones a replica's run writes; seconds and already_done are the caller's)."""
        self.conversations += other.conversations
        self.copied += other.copied
        self.turns += other.turns
        self.generated_tokens += other.generated_tokens
        self.row_steps += other.row_steps
        self.dropped.update(other.dropped)

    def row_use(self) -> float:
        """Generated tokens / decoding steps paid for: a batch decodes until its longest reply ends, and a row
        whose reply ended earlier (or a dummy row filling the batch) still rides along."""
        return self.generated_tokens / max(self.row_steps, 1)

    def line(self) -> str:
        s = max(self.seconds, 1e-9)
        dropped = ", ".join(f"{k}={n}" for k, n in sorted(self.dropped.items())) or "none"
        return (f"regenerated {self.conversations} conversations ({self.turns} replies, {self.generated_tokens:,} "
                f"tokens) in {self.seconds:.1f}s: {self.conversations / s:.2f} conversations/s, "
                f"{self.generated_tokens / s:,.1f} generated tokens/s ({self.row_use():.0%} of the batch rows' "
                f"decoding steps produced a token); {self.already_done} already done, "
                f"{self.copied} copied unchanged; dropped: {dropped}")


@dataclass
class _Chat:
    """One conversation being regenerated: the source turns and the rebuilt history."""
    rid: str
    source: list[dict]
    messages: list[dict] = field(default_factory=list)
    next: int = 0     # index of the next source message to consume
    replies: int = 0

    def advance(self) -> bool:
        """Move the source turns before the next assistant turn into the history; True if a reply is due."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.messages.append(self.source[self.next])
            self.next += 1
        return self.next < len(self.source)

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.next += 1  # the original answer is replaced, never shown to the target
        self.replies += 1

    def record(self) -> dict:
        messages = list(self.messages)
        while messages and messages[-1]["role"] != "assistant":  # cut before a turn: its question has no answer
            messages.pop()
        return {"id": self.rid, "messages": messages}


# ---------------------------------------------------------------------------------------------- sources

def iter_source_records(source: str, counts: Counter) -> Iterator[tuple[str, Conversation]]:
    """(record id, conversation) in file order; ids are unique and keep the conversation's split key."""
    seen: Counter = Counter()
    with open_source(source) as path:
        for conv in iter_conversations(path, counts):
            n = seen[conv.key]
            seen[conv.key] += 1
            yield f"{conv.key}_{n}", conv


def read_done_ids(out_path: Path) -> set[str]:
    """Ids already in the output. A last line cut by a crash (no newline) is removed, so appends stay valid."""
    if not out_path.is_file():
        return set()
    data = out_path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(out_path, "r+b") as f:
            f.truncate(end)
        log.warning(f"{out_path}: removed an incomplete last line (an interrupted run); it will be regenerated")
    done = set()
    for line in data[:end].decode("utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            done.add(str(json.loads(line)["id"]))
    return done


def check_settings(out_path: Path, settings: RegenerateSettings, replace: bool) -> None:
    """Refuse (or, with replace, start over) when out_path was written with other settings."""
    meta = out_path.with_suffix(".meta.json")
    want = dataclasses.asdict(settings)
    if out_path.is_file() and out_path.stat().st_size > 0:
        have = json.loads(meta.read_text()) if meta.is_file() else None
        if have != want:
            if not replace:
                diff = "unknown settings" if have is None else ", ".join(
                    f"{k}={have.get(k)!r} (now {v!r})" for k, v in want.items() if have.get(k) != v)
                raise UserError(f"{out_path} holds regenerated conversations made with other settings ({diff}); "
                                "pass another output path, or delete the file to start over.")
            log.warning(f"{out_path} was regenerated with other settings: starting over")
            out_path.unlink()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(want, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- generation

def auto_batch_size(kv_bytes_per_token: int, max_length: int, free_bytes: int | None) -> int:
    """`--batch-size auto`: the batch whose full KV caches (max_length slots per row) fill half the free memory
    (the other half: the prefill's activations and masks, which grow with batch x prompt length), rounded down to
    a multiple of 64 rows, between 1 and MAX_AUTO_BATCH. free_bytes None (CPU): CPU_BATCH."""
    if free_bytes is None:
        return CPU_BATCH
    rows = free_bytes // 2 // max(1, kv_bytes_per_token * max_length)
    return int(max(1, min(MAX_AUTO_BATCH, rows // 64 * 64 if rows >= 64 else rows)))


def parse_batch_size(spec) -> int | None:
    """--batch-size: a positive integer, or 'auto' (None: sized by batch_size_for once the models are loaded)."""
    if str(spec).strip().lower() == "auto":
        return None
    try:
        n = int(spec)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"--batch-size must be a positive integer or 'auto' (got {spec!r}).")
    return n


def batch_size_for(models, max_length: int) -> int:
    """auto_batch_size for the tightest of the models' devices (their KV bytes per token and free memory)."""
    from ..models.target import TargetInfo

    sizes = []
    for hf in models:
        info = TargetInfo.from_config(hf.config)
        weight = hf.get_input_embeddings().weight
        kv = 2 * info.num_layers * info.num_key_value_heads * info.head_dim * weight.element_size()
        free = torch.cuda.mem_get_info(weight.device)[0] if weight.device.type == "cuda" else None
        sizes.append(auto_batch_size(kv, max_length, free))
    return min(sizes)


def cache_slots(needed: int, max_length: int) -> int:
    """Static cache size for a batch needing `needed` slots: a power of two from MIN_CACHE_SLOTS, capped at
    max_length (few sizes, so a run allocates few caches)."""
    slots = MIN_CACHE_SLOTS
    while slots < needed:
        slots *= 2
    return max(min(slots, max_length), needed)


class Regenerator:
    """Batched turn-by-turn regeneration with one HF causal LM. Conversations flow through a pool: every round
    generates the next reply of up to batch_size conversations, so multi-turn chats never hold a batch half empty
    while new conversations are waiting. lookahead: batches per sorted pool (1 = batches in arrival order)."""

    def __init__(self, hf, tokenizer, settings: RegenerateSettings, batch_size: int, stop_ids,
                 lookahead: int = LOOKAHEAD_BATCHES):
        self.hf, self.tokenizer, self.settings, self.batch_size = hf, tokenizer, settings, batch_size
        self.stop_ids, self.lookahead = list(stop_ids), max(1, lookahead)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        device = hf.get_input_embeddings().weight.device
        self.generator = (torch.Generator(device=device).manual_seed(settings.seed)
                          if settings.temperature > 0 else None)
        self._generator = None  # the BatchGenerator (its cache and captured steps), grown when a batch needs more

    def _prompt_ids(self, chat: _Chat) -> list[int] | None:
        from ..inference.prompts import Prompt, tokenize_prompts

        try:
            return tokenize_prompts([Prompt("messages", chat.messages)], self.tokenizer)[0]
        except jinja2.TemplateError:  # e.g. a template that insists on alternating roles
            return None

    def _batch_generator(self, slots_needed: int):
        from ..inference.baseline import BatchGenerator

        if self._generator is None or self._generator.runner.max_len < slots_needed:
            self._generator = None  # free the smaller cache (and its graphs) before allocating the larger one
            gc.collect()            # a runner and its captured steps reference each other: only gc frees them
            slots = cache_slots(slots_needed, self.settings.max_length)
            self._generator = BatchGenerator(self.hf, self.batch_size, slots)
        return self._generator

    def run(self, items: Iterable[tuple[str, Conversation, bool]], write, flush, stats: RegenerateStats,
            bar: tqdm, stop: threading.Event | None = None) -> None:
        """items: (id, conversation, regenerate?); False copies the conversation unchanged. write(record) for each
        finished conversation, flush() after every batch. A set `stop` ends the run before its next batch."""
        s = self.settings
        t0 = time.perf_counter()
        pool: list[tuple[_Chat, list[int]]] = []  # conversations with a reply due, and its prompt ids
        source = iter(items)

        def finish(chat: _Chat, reason: str | None = None) -> None:
            if chat.replies:
                write(chat.record())
                stats.conversations += 1
            else:
                stats.dropped[reason or "no_reply"] += 1
            bar.update()

        def enqueue(chat: _Chat) -> None:
            """Queue the chat's next reply, or finish it (no assistant turn left, or the prompt does not fit)."""
            if s.single_turn and chat.replies:
                return finish(chat)
            if not chat.advance():
                return finish(chat)
            ids = self._prompt_ids(chat)
            if ids is None:
                return finish(chat, "template_error")
            if len(ids) + s.max_new_tokens > s.max_length:
                return finish(chat, "prompt_longer_than_max_length")
            pool.append((chat, ids))

        exhausted = False
        b = self.batch_size
        chunk: list[tuple[_Chat, list[int]]] = []  # the sorted pool being cut into batches
        while True:
            if not chunk:
                while len(pool) < b * self.lookahead and not exhausted:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    rid, conv, regen = item
                    if not regen:
                        write({"id": rid, "messages": conv.messages})
                        stats.copied += 1
                        bar.update()
                        continue
                    enqueue(_Chat(rid, conv.messages))
                if not pool:
                    flush()
                    return
                pool.sort(key=lambda item: len(item[1]))  # stable: ties keep arrival order (deterministic output)
                n = len(pool) if exhausted else len(pool) // b * b  # a part batch waits for the next pool
                chunk, pool[:] = pool[:n], pool[n:]
            if stop is not None and stop.is_set():
                flush()
                return
            batch, chunk = chunk[:b], chunk[b:]
            prompts = [ids for _, ids in batch]
            gen = self._batch_generator(max(len(p) for p in prompts) + s.max_new_tokens)
            outs = gen.generate(prompts, s.max_new_tokens, self.stop_ids, s.temperature, self.generator, self.pad_id)
            stats.row_steps += gen.runner.batch_size * gen.last_steps
            for (chat, _), tokens in zip(batch, outs):
                stats.turns += 1
                stats.generated_tokens += len(tokens)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
                if not text:  # an empty turn would be dropped by the reader and break the turn order
                    finish(chat, "empty_reply")
                    continue
                chat.add_reply(text)
                enqueue(chat)
            flush()
            bar.set_postfix_str(f"{stats.generated_tokens / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)


def regenerate_dataset(models, tokenizer, items: Iterable[tuple[str, Conversation, bool]], out_path: str | Path,
                       settings: RegenerateSettings, batch_size: int, total: int | None = None,
                       replace_mismatch: bool = False,
                       stop: threading.Event | None = None) -> RegenerateStats:
    """Regenerate `items` ((id, conversation, regenerate?) in order) into out_path (JSONL, appended, resumable).

    models: one HF causal LM, or a list of replicas (one per device). Several replicas each run a Regenerator in
    a thread on their own device, drawing conversations from one shared iterator (a free replica takes the next
    ones: no fixed shards to wait for); records are written as they finish, so the file's order then interleaves
    the devices (readers key on the id). A replica that fails stops the others before their next batch, and the
    error names its device. A set `stop` (a signal, see the CLI) ends every replica before its next batch: what
    was written stays, and a rerun resumes after it."""
    from ..inference.benchmark import stop_token_ids

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    if batch_size < 1:
        raise UserError("The regeneration batch size must be at least 1.")
    out_path = Path(out_path)
    check_settings(out_path, settings, replace_mismatch)
    done = read_done_ids(out_path)
    stats = RegenerateStats()
    stop_ids = stop_token_ids(models[0], tokenizer)
    # Tokenizers are not safe to share between threads: every extra replica gets its own copy.
    regens = [Regenerator(hf, tokenizer if i == 0 else copy.deepcopy(tokenizer), settings, batch_size, stop_ids)
              for i, hf in enumerate(models)]
    t0 = time.perf_counter()
    lock = threading.Lock()
    with open(out_path, "a", encoding="utf-8") as f, \
            tqdm(total=total, desc="regenerating", unit="conv", disable=None, leave=False) as bar:
        def todo():
            for rid, conv, flag in items:
                if rid in done:
                    stats.already_done += 1
                    bar.update()
                else:
                    yield rid, conv, flag

        def write(record: dict) -> None:
            line = json.dumps(record, ensure_ascii=False) + "\n"
            with lock:
                f.write(line)

        def flush() -> None:
            with lock:
                f.flush()

        # Flushed after every batch: a crash loses at most the batch in flight (and read_done_ids drops a cut line).
        if len(regens) == 1:
            regens[0].run(todo(), write, flush, stats, bar, stop)
        else:
            _run_replicas(regens, todo(), write, flush, stats, bar, stop or threading.Event())
    stats.seconds = time.perf_counter() - t0
    log.info(stats.line())
    return stats


def _run_replicas(regens: list[Regenerator], items: Iterator, write, flush, stats: RegenerateStats,
                  bar: tqdm, stop: threading.Event) -> None:
    """One thread per replica over a shared iterator; per-replica stats summed into `stats`. `stop` ends them all
    before their next batch (set by a failing replica, or by the caller)."""
    source_lock = threading.Lock()
    failures: list[tuple[str, BaseException, str]] = []
    parts = [RegenerateStats() for _ in regens]

    def shared():
        while not stop.is_set():
            with source_lock:
                item = next(items, None)
            if item is None:
                return
            yield item

    def work(regen: Regenerator, part: RegenerateStats) -> None:
        device = regen.hf.get_input_embeddings().weight.device
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                regen.run(shared(), write, flush, part, bar, stop)
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread, with its traceback
            failures.append((str(device), e, traceback.format_exc()))
            stop.set()

    threads = [threading.Thread(target=work, args=(r, p), name=f"dflash-regenerate{i}", daemon=True)
               for i, (r, p) in enumerate(zip(regens, parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in parts:
        stats.add(p)
    if failures:
        device, exc, tb = failures[0]
        if isinstance(exc, UserError):  # the user's to fix: one sentence, as on one device
            raise exc
        raise RuntimeError(f"regeneration on {device} failed ({type(exc).__name__}: {exc}); the other devices "
                           f"stopped after their current batch and every finished conversation is saved (rerun "
                           f"to resume).\n{tb}") from exc


def _select(source: str, max_samples: int | None, counts: Counter) -> Iterator[tuple[str, Conversation, bool]]:
    for n, (rid, conv) in enumerate(iter_source_records(source, counts)):
        if max_samples is not None and n >= max_samples:
            return
        yield rid, conv, True


# ---------------------------------------------------------------------------------------------- entry points

def regenerate_for_run(cfg, out_dir: Path, tokenizer):
    """data.regenerate: regenerate the run's training conversations (the first data.max_samples on the training
    side of the split) into <out_dir>/regenerated.jsonl, copy the held-out side unchanged (its prompts are what
    evaluation uses), and return the DataConfig that reads that file."""
    from ..models.target import load_causal_lm
    from ..pipeline.devices import resolve_pipeline_devices
    from .conversations import is_heldout

    d = cfg.data
    targets, drafters = resolve_pipeline_devices(cfg.pipeline)
    devices = list(dict.fromkeys(targets + drafters))  # every device the run will use, once each
    out_path = Path(out_dir) / "regenerated.jsonl"
    settings = RegenerateSettings(source=d.source, target=str(cfg.model.target or "smollm2"),
                                  max_new_tokens=d.regenerate_max_new_tokens, temperature=0.0, single_turn=False,
                                  max_length=d.max_length, seed=cfg.train.seed)
    counts: Counter = Counter()
    cap = {False: d.max_samples, True: d.heldout_max if d.heldout_fraction > 0 else 0}

    def items():
        taken = {False: 0, True: 0}
        for rid, conv in iter_source_records(d.source, counts):
            held = is_heldout(conv.key, cfg.train.seed, d.heldout_fraction)
            if cap[held] is None or taken[held] < cap[held]:
                taken[held] += 1
                yield rid, conv, not held
            if all(cap[h] is not None and taken[h] >= cap[h] for h in (False, True)):
                return

    total = None if d.max_samples is None else d.max_samples + cap[True]
    log.info(f"data.regenerate: the target rewrites {d.max_samples or 'all'} training conversations of "
             f"{d.source!r} into {out_path} on {', '.join(map(str, devices))}")
    models = [load_causal_lm(cfg.model.target, dev) for dev in devices]
    cuda = devices[0].type == "cuda"
    batch = batch_size_for(models, d.max_length)
    log.info(f"data.regenerate: {batch} conversations per batch on each device")
    regenerate_dataset(models, tokenizer, items(), out_path, settings, batch_size=batch,
                       total=total, replace_mismatch=cfg.run.overwrite)
    if d.self_prompts:  # prompts the target writes itself, answered into the same file (generation/self_prompts.py)
        from ..generation.self_prompts import answer_self_prompts
        d = answer_self_prompts(cfg, Path(out_dir), tokenizer, models, batch, out_path, settings)
    del models
    gc.collect()  # the runners' reference cycles hold the models, caches and graph pools until collected
    if cuda:
        torch.cuda.empty_cache()
    return dataclasses.replace(d, source=str(out_path), regenerate=False)


def parse_devices(spec: str) -> list[torch.device]:
    """--device: 'auto', 'all' (every visible GPU, else the CPU), or a comma-separated list ('cuda:0,cuda:1')."""
    from ..devices import parse_device

    if spec.strip() == "all":
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] if n else [torch.device("cpu")]
    names = [x for x in spec.split(",") if x.strip()]
    if not names:
        raise UserError("--device is empty; use 'auto', 'all', 'cpu', 'cuda:N' or a comma-separated list of them.")
    return [parse_device(x, "--device") for x in names]


def run_regenerate_cli(args) -> int:
    from ..models.target import load_causal_lm, load_tokenizer
    from ..pipeline.worker import RunControl, signal_exit_code, stop_on_signals

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1.")
    if args.temperature < 0:
        raise UserError("--temperature must be 0 (greedy) or positive.")
    if args.max_samples is not None and args.max_samples < 1:
        raise UserError("--max-samples must be at least 1.")
    fixed_batch = parse_batch_size(args.batch_size)
    out_path = Path(args.out)
    if out_path.suffix != ".jsonl":
        raise UserError(f"--out {args.out!r} must be a .jsonl file (one conversation per line).")
    if args.data == "synthetic":
        raise DataError("regenerate needs chat data: pass --data sharegpt or a .json/.jsonl chat file.")
    settings = RegenerateSettings(source=args.data, target=str(args.target or "smollm2"),
                                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  single_turn=args.single_turn, max_length=args.max_length, seed=args.seed)
    with open_source(args.data):  # a bad --data fails here, before the model loads
        pass
    check_settings(out_path, settings, replace=False)
    devices = parse_devices(args.device)
    tokenizer = load_tokenizer(args.target)
    models = [load_causal_lm(args.target, d) for d in devices]
    batch = fixed_batch or batch_size_for(models, args.max_length)
    log.info(f"regenerate: {batch} conversations per batch on each of {len(models)} device(s)")
    counts: Counter = Counter()
    control = RunControl()
    with stop_on_signals(control, "the current batch, which is written first"):
        stats = regenerate_dataset(models, tokenizer, _select(args.data, args.max_samples, counts), out_path,
                                   settings, batch, total=args.max_samples, stop=control.stop)
    skipped = {k.removeprefix("skip:"): n for k, n in counts.items() if k.startswith("skip:")}
    if skipped:
        log.info("source records skipped as unusable: " + ", ".join(f"{k}={n}" for k, n in sorted(skipped.items())))
    print(stats.line())
    if control.interrupted:
        print(f"stopped by {control.interrupted}: {out_path} holds every finished conversation; rerun the same "
              "command to resume")
        return signal_exit_code(control.interrupted)
    print(f"wrote {out_path} (train on it with data.source={out_path})")
    return 0
