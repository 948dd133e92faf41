"""Chat conversations -> token ids + assistant-only loss mask, split into train / held-out, cached on disk.

The drafter learns to predict what the target *generates*: each assistant turn's content and the end-of-turn token
that closes it (so drafts learn to stop), never the role headers, system prompts or user turns that the serving
engine writes itself. Conversations are rendered with the tokenizer's own chat template, so training sees exactly
the token layout the target sees when it serves.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, groupby
from multiprocessing import get_context
from pathlib import Path

import jinja2
import numpy as np

from ..config import DataConfig
from .packing import DatasetSplit, Sample
from .progress import progress_bar
from .sources import SOURCE_HINT, Conversation, DataError, iter_conversations, open_source

__all__ = ["ChatEncoder", "DataError", "is_heldout", "load_chat_dataset"]

log = logging.getLogger("dflash_train")

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
CACHE_VERSION = 2    # bump when the sample format or the masking rule changes
ENCODE_BATCH = 64    # conversations per tokenizer call: the fast tokenizer parallelises over a batch
AUTO_WORKERS_MIN_BYTES = 16 * 2**20  # data.tokenize_workers=auto: smaller files tokenize in this process, and
AUTO_WORKERS_MIN_SAMPLES = 4096      # so do fewer conversations of a large one (the compile warm-up reads 512)
# data.tokenize_workers=auto: at most this many workers. On the 16-core GPU host (2026-12-07, ShareGPT chats, the
# SmolLM2 tokenizer, benchmarks/tokenize_cpu.py): 8 workers 2.3-2.7k conv/s, 12 3.3-3.7k, 15 3.0-4.5k.
AUTO_WORKERS_MAX = 15


class ChatEncoder:
    """Messages -> `Sample` (ids, loss mask) with a tokenizer's own chat template, truncated to `max_length`.

    Templates with `{% generation %}` markers say themselves which characters the assistant produces; we trust
    them (`return_assistant_tokens_mask`). Otherwise each assistant turn is located in the rendered text: the
    conversation prefix rendered with `add_generation_prompt=True` ends exactly where the turn's content may begin,
    the content is found from there (templates may insert e.g. an empty think block first), and the special token
    right after it is the end-of-turn token. Character spans map to tokens through the fast tokenizer's offsets.
    """

    def __init__(self, tokenizer, max_length: int):
        try:
            self.template = tokenizer.get_chat_template()
        except ValueError:
            self.template = None
        if not self.template:
            raise DataError(f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so chat data "
                            "cannot be rendered; use an instruct/chat model as model.target, add a \"chat_template\" "
                            "to its tokenizer_config.json (or a chat_template.jinja file beside it), or train on "
                            "data.source=synthetic.")
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(f"Tokenizer {tokenizer.name_or_path!r} is not a fast (Rust) tokenizer, so assistant "
                            "tokens cannot be located; load the model's tokenizer.json (AutoTokenizer, use_fast=True).")
        self.tokenizer, self.max_length = tokenizer, max_length
        self.use_markers = bool(GENERATION_TAG.search(self.template))
        self.special_ids = special_token_ids(tokenizer)

    @property
    def mask_rule(self) -> str:
        return "generation_markers" if self.use_markers else "template_spans"

    def encode(self, batch: list[list[dict]]) -> list[Sample | str]:
        """One result per conversation, in order: a Sample, or a str naming why it was skipped."""
        if self.use_markers:
            return [self._encode_marked(m) for m in batch]
        # A template may refuse a conversation (e.g. roles that do not alternate): that one is skipped, not the run.
        out: list[Sample | str] = ["template_error"] * len(batch)
        texts: dict[int, str] = {}
        for i, messages in enumerate(batch):
            with contextlib.suppress(jinja2.TemplateError):
                texts[i] = self._render(messages)
        if not texts:
            return out
        enc = self.tokenizer(list(texts.values()), add_special_tokens=False, return_offsets_mapping=True)
        for (i, text), ids, offsets in zip(texts.items(), enc["input_ids"], enc["offset_mapping"]):
            with contextlib.suppress(jinja2.TemplateError):
                out[i] = self._encode_spans(batch[i], text, ids, offsets)
        return out

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode_marked(self, messages: list[dict]) -> Sample | str:
        try:
            enc = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        except jinja2.TemplateError:
            return "template_error"
        ids, mask = list(enc["input_ids"]), [bool(x) for x in enc["assistant_masks"]]
        return self._finish(ids, self._unmask_cut_ends(messages, ids, mask))

    def _unmask_cut_ends(self, messages: list[dict], ids: list[int], mask: list[bool]) -> list[bool]:
        """The template's assistant mask with the end-of-turn token of each reply marked "truncated" left out: the
        regeneration cut that reply at max_new_tokens, so the target never emitted that token there. The masked
        runs are the assistant turns in order; a run's end-of-turn is its last token when that is special."""
        cut = [bool(m.get("truncated")) for m in messages if m["role"] == "assistant"]
        if not any(cut):
            return mask
        run_ends = [list(run)[-1] for masked, run in groupby(range(len(mask)), key=mask.__getitem__) if masked]
        for end, is_cut in zip(run_ends, cut):
            if is_cut and ids[end] in self.special_ids:
                mask[end] = False
        return mask

    def _encode_spans(self, messages: list[dict], text: str, ids: list[int],
                      offsets: list[tuple[int, int]]) -> Sample | str:
        # Turns that start past the truncation point cannot contribute: don't render their prefixes.
        char_limit = offsets[self.max_length - 1][1] if len(ids) > self.max_length else len(text)
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                # Walk past other turns' text so an answer quoted in the question is not mistaken for the answer
                # (matters only when the prefix renders below are not prefixes of the full text).
                found = text.find(m["content"], cursor)
                cursor = cursor if found < 0 else found + len(m["content"])
                continue
            prefix = self._render(messages[:i], add_generation_prompt=True)
            # Some templates re-render history (e.g. a header that counts the messages): then the walk above is all
            # we have; otherwise the prefix says exactly where this turn's text begins.
            if text.startswith(prefix):
                cursor = len(prefix)
            if cursor >= char_limit:
                break
            start = text.find(m["content"], cursor)
            if start < 0:
                return "assistant_content_not_in_template_output"  # the template rewrites content
            cursor = start + len(m["content"])
            spans.append((start, cursor, bool(m.get("truncated"))))
        mask = [False] * len(ids)
        t = 0
        for start, end, cut in spans:
            while t < len(ids) and offsets[t][1] <= start:
                t += 1
            while t < len(ids) and offsets[t][0] < end:  # every token overlapping the content
                mask[t] = True
                t += 1
            if cut:  # a reply cut at max_new_tokens: the target did not end its turn there (_unmask_cut_ends)
                continue
            # The end-of-turn token: the first special token after the content, only whitespace in between.
            u = t
            while u < len(ids) and ids[u] not in self.special_ids and not text[offsets[u][0]:offsets[u][1]].strip():
                u += 1
            if u < len(ids) and ids[u] in self.special_ids:
                mask[t:u + 1] = [True] * (u + 1 - t)
                t = u + 1
        return self._finish(list(ids), mask)

    def _finish(self, ids: list[int], mask: list[bool]) -> Sample | str:
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            return "no_assistant_tokens_within_max_length"
        return Sample(ids, mask)


def special_token_ids(tokenizer) -> set[int]:
    """Every special token id: the added special tokens (e.g. <|im_end|>) and the named ones (bos, eos, pad)."""
    return {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)


def is_heldout(key: str, seed: int, fraction: float) -> bool:
    """A stable coin flip per conversation: sha1(seed, key) as a number in [0, 1) below `fraction`.
    Independent of file order, batch size and max_samples, so the same seed always holds out the same chats."""
    h = hashlib.sha1(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64 < fraction


def load_chat_dataset(cfg: DataConfig, tokenizer, seed: int = 0, cache_dir: str | None = None) -> DatasetSplit:
    """Read `cfg.source`, tokenize with the chat template, split train / held-out; cached under `cache_dir`
    (default `cfg.cache_dir`; None = no cache)."""
    if tokenizer is None:
        raise DataError(f"data.source={cfg.source!r} is chat data and needs the target's tokenizer; "
                        "pass one, or use data.source=synthetic.")
    encoder = ChatEncoder(tokenizer, cfg.max_length)
    cache_dir = cache_dir if cache_dir is not None else cfg.cache_dir
    t0 = time.perf_counter()
    with open_source(cfg.source) as path:
        cache_path = _cache_path(cache_dir, cfg, path, encoder, seed) if cache_dir else None
        if cache_path is not None and cache_path.is_file():
            split = _load_cache(cache_path)
            split.stats["cache"] = "hit"
        else:
            split = _build_split(cfg, path, encoder, seed)
            split.stats["cache"] = "off" if cache_path is None else "miss"
            if cache_path is not None:
                try:
                    _save_cache(split, cache_path)
                except OSError as e:  # the cache only saves time: a directory we cannot write costs a warning
                    log.warning("tokenized data not cached: %s cannot be written (%s); set data.cache_dir to a "
                                "directory you can write to", cache_path.parent, e.strerror)
                    split.stats["cache"] = "unwritable"
    _log_summary(split.stats, time.perf_counter() - t0)
    return split


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS keeps one, else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenize_workers(cfg: DataConfig, path: Path) -> int:
    """data.tokenize_workers, resolved: the number of worker processes (0: tokenize in this process)."""
    if cfg.tokenize_workers is not None:
        return cfg.tokenize_workers
    if sys.platform != "linux":  # workers would be spawned (_Batches): worth it only where a user asks for them
        return 0
    cores = usable_cores()
    few = cfg.max_samples is not None and cfg.max_samples < AUTO_WORKERS_MIN_SAMPLES  # read only the file's start
    if cores < 4 or few or path.stat().st_size < AUTO_WORKERS_MIN_BYTES:
        return 0
    return min(AUTO_WORKERS_MAX, cores - 1)


_worker_encoder: ChatEncoder | None = None  # a worker process's own copy (_start_worker)


def _start_worker(encoder: ChatEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder
    # The fast tokenizer's thread pool does not survive a fork. The tokenizers library turns it off in a forked
    # child by itself, unless TOKENIZERS_PARALLELISM is set: with it set to true, the child's first batch waits
    # forever on threads that do not exist (seen on the dev box). The workers are the parallelism here.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_in_worker(batch: list[list[dict]]) -> list[Sample | str]:
    return _worker_encoder.encode(batch)


class _Batches:
    """ChatEncoder.encode over batches, results in submission order: in this process, or in `workers` processes
    with up to 2 x workers batches in flight. submit() returns the batches whose results are in.

    The workers are forked on Linux (as torch's DataLoader workers are): they only tokenize, never touch CUDA or
    the caller's threads, and inherit the encoder without pickling it. Spawned workers would re-import the caller's
    main module: a script without an `if __name__ == "__main__"` guard then fails in each worker, and on Python
    3.11 the parent hangs writing the encoder to the dead worker's pipe (seen on the dev box). Elsewhere they are
    spawned (fork is unsafe on macOS)."""

    def __init__(self, encoder: ChatEncoder, workers: int):
        self.encoder, self.pool = encoder, None
        self.in_flight: deque[tuple[list, Future]] = deque()
        self.limit = 2 * workers
        self._count = {False: 0, True: 0}  # conversations in flight, by destination (held out or not)
        if workers > 0:
            method = "fork" if sys.platform == "linux" else "spawn"
            self.pool = ProcessPoolExecutor(workers, mp_context=get_context(method), initializer=_start_worker,
                                            initargs=(encoder,))

    def submit(self, batch: list[tuple[Conversation, bool]]) -> list[tuple[list, list[Sample | str]]]:
        messages = [conv.messages for conv, _ in batch]
        if self.pool is None:
            return [(batch, self.encoder.encode(messages))]
        self.in_flight.append((batch, self.pool.submit(_encode_in_worker, messages)))
        for _, held in batch:
            self._count[held] += 1
        done = []
        while len(self.in_flight) > self.limit or (self.in_flight and self.in_flight[0][1].done()):
            done.append(self._pop())
        return done

    def drain(self) -> list[tuple[list, list[Sample | str]]]:
        """Every batch still in flight, waited for."""
        return [self._pop() for _ in range(len(self.in_flight))]

    def _pop(self) -> tuple[list, list[Sample | str]]:
        batch, future = self.in_flight.popleft()
        for _, held in batch:
            self._count[held] -= 1
        try:
            return batch, future.result()
        except BrokenProcessPool as e:
            raise DataError("A tokenizing worker process died (killed, e.g. out of memory); set "
                            "data.tokenize_workers=0 to tokenize in the run's own process, or fewer workers.") from e

    def pending(self, held: bool) -> int:
        """Conversations of one destination still in flight."""
        return self._count[held]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def tokenize_into_cache(cfg: DataConfig, tokenizer, seed: int, cache_dir: str, until) -> Path:
    """cfg.source, a .jsonl file that another process is still writing, tokenized as it grows (until() true: the
    file is complete) and saved in the cache under the finished file's key, so that load_chat_dataset with the same
    cfg, tokenizer, seed and cache_dir is then a cache hit (data/tokenize_ahead.py runs this beside a regeneration).
    Returns the cache file."""
    encoder = ChatEncoder(tokenizer, cfg.max_length)
    path = Path(cfg.source).expanduser()  # as open_source names it
    split = _build_split(cfg, path, encoder, seed, until=until, workers=0)
    split.stats["cache"] = "miss"  # as load_chat_dataset saves it (a load says "hit")
    cache_path = _cache_path(cache_dir, cfg, path, encoder, seed)  # the finished file's: read after until() held
    _save_cache(split, cache_path)
    return cache_path


def _build_split(cfg: DataConfig, path: Path, encoder: ChatEncoder, seed: int, until=None,
                 workers: int | None = None) -> DatasetSplit:
    """Stream conversations in file order; route each by `is_heldout`; tokenize only what will be kept.

    Train = the first `max_samples` train-side conversations that tokenize to a usable sample; held-out = the first
    `heldout_max` held-out-side ones (later held-out-side chats are dropped, never trained on). Reading stops as soon
    as both are full. Conversations not yet tokenized (pending here or in flight in a worker) count as kept; as soon
    as that count would fill a destination, everything is tokenized and waited for, so the decision for every
    conversation is exact and the result depends neither on ENCODE_BATCH nor on data.tokenize_workers.
    until: the file is still being written (iter_conversations). workers: tokenize_workers(cfg, path) if None."""
    counts: Counter = Counter()
    keys: Counter = Counter()  # conversations per split key: one key for most of the file is a naming collision
    cap = {False: cfg.max_samples if cfg.max_samples is not None else math.inf,
           True: cfg.heldout_max if cfg.heldout_fraction > 0 else 0}
    kept: dict[bool, list[tuple[Conversation, Sample]]] = {False: [], True: []}
    pending: list[tuple[Conversation, bool]] = []
    pending_by_side = {False: 0, True: 0}  # pending's conversations by destination (held out or not)
    n_read, stopped_early = 0, False
    workers = tokenize_workers(cfg, path) if workers is None else workers
    if workers:
        log.info(f"tokenizing chats in {workers} worker processes (data.tokenize_workers)")
    batches = _Batches(encoder, workers)

    # the samples hold no reference cycles: the collector would only walk them (_collector_paused)
    with _collector_paused(), progress_bar(total=None if cap[False] == math.inf else cap[False],
                                           desc="tokenizing chats", unit="conv", leave=False) as bar:  # lines off a TTY
        def keep(done: list[tuple[list, list[Sample | str]]]) -> None:
            for batch, results in done:
                for (conv, held), result in zip(batch, results):
                    if isinstance(result, str):
                        counts[f"skip:{result}"] += 1
                    elif len(kept[held]) < cap[held]:
                        kept[held].append((conv, result))
                        if not held:
                            bar.update()

        def flush(wait: bool) -> None:
            if pending:
                keep(batches.submit(list(pending)))
                pending.clear()
                pending_by_side.update({False: 0, True: 0})
            if wait:
                keep(batches.drain())

        try:
            for conv in iter_conversations(path, counts, until):
                n_read += 1
                keys[conv.key] += 1
                held = is_heldout(conv.key, seed, cfg.heldout_fraction)
                n_pending = pending_by_side[held] + batches.pending(held)
                if len(kept[held]) + n_pending >= cap[held]:
                    counts["heldout_overflow" if held else "unused_after_train_full"] += 1
                    if all(len(kept[h]) >= cap[h] for h in (False, True)):
                        stopped_early = True
                        break
                    continue
                pending.append((conv, held))
                pending_by_side[held] += 1
                if len(kept[held]) + n_pending + 1 >= cap[held]:
                    flush(wait=True)
                elif len(pending) >= ENCODE_BATCH:
                    flush(wait=False)
            flush(wait=True)
        finally:
            batches.close()

    train, heldout = [s for _, s in kept[False]], [s for _, s in kept[True]]
    skipped = {k.removeprefix("skip:"): n for k, n in sorted(counts.items()) if k.startswith("skip:")}
    if not train and n_read == 0 and not skipped:
        raise DataError(f"Data file {str(path)!r} holds no records; fill it with chat conversations or {SOURCE_HINT}.")
    collision = _key_collision(keys, n_read) if cfg.heldout_fraction > 0 else None
    if not train:
        raise DataError(_no_training_data(cfg, path, n_read, skipped, collision))
    stats = {
        "source": cfg.source, "path": str(path), "mask_rule": encoder.mask_rule,
        "conversations": n_read, "train": len(train), "heldout": len(heldout),
        "train_tokens": sum(len(s.input_ids) for s in train),
        "train_loss_tokens": sum(sum(s.loss_mask) for s in train),
        "at_max_length": sum(len(s.input_ids) == cfg.max_length for s in train + heldout),  # ~ truncated
        "max_length": cfg.max_length, "stopped_early": stopped_early, "skipped": skipped,
        **({"key_collision": collision} if collision else {}),
        **{k: n for k, n in counts.items() if not k.startswith("skip:")},
    }
    return DatasetSplit(train=train, heldout=heldout, heldout_messages=[c.messages for c, _ in kept[True]],
                        stats=stats, heldout_keys=[str(c.key) for c, _ in kept[True]])


def _key_collision(keys: Counter, n_read: int) -> str | None:
    """A sentence when one split key holds at least half of the conversations read (and two or more of them): the
    split keeps a key's conversations on one side, so the file cannot be split. The usual cause is ids such as
    `identity_0`, `identity_1`, ..., which the ShareGPT convention (sources._record_key) reads as parts of one chat
    (ShareGPT's own largest chat has 89 parts of 17,390 records)."""
    if not keys:
        return None
    key, n = keys.most_common(1)[0]
    if n < 2 or 2 * n < n_read:
        return None
    return (f"{n} of the {n_read} conversations read share the split key {key!r} (ids like '{key}_0', '{key}_1' "
            "read as parts of one chat), so they all fall on the same side of the train/held-out split; give each "
            "conversation an id that does not end in _<number>, or no id")


def _no_training_data(cfg: DataConfig, path: Path, n_read: int, skipped: dict[str, int],
                      collision: str | None = None) -> str:
    """Why no conversation reached the training side, with the fix that applies (not always the file's format)."""
    where = f"Data file {str(path)!r} gave no usable training conversations"
    if not skipped and collision:
        return f"{where}: {collision}."
    if not skipped:  # every conversation read went to the held-out side
        return (f"{where}: all {n_read} conversations read fell on the held-out side (data.heldout_fraction="
                f"{cfg.heldout_fraction}); lower data.heldout_fraction or use a larger file.")
    top = max(skipped, key=skipped.get)
    if top == "no_assistant_tokens_within_max_length":
        return (f"{where} (skipped: {skipped}): no assistant answer starts within data.max_length={cfg.max_length} "
                "tokens; raise data.max_length.")
    if top == "tool_calls":
        return (f"{where} (skipped: {skipped}): conversations with tool calls are not supported; use plain chat "
                "conversations.")
    if top in ("template_error", "assistant_content_not_in_template_output"):
        return (f"{where} (skipped: {skipped}): the target's chat template refuses or rewrites these conversations; "
                "use another chat template or data.source.")
    return (f"{where} (skipped: {skipped}); check its format (ShareGPT 'conversations' or OpenAI 'messages' "
            f"records) or {SOURCE_HINT}.")


# ---------------------------------------------------------------------------------------------- cache

def _cache_path(cache_dir: str, cfg: DataConfig, path: Path, encoder: ChatEncoder, seed: int) -> Path:
    """The cache file of `path` tokenized with these settings (load_chat_dataset, tokenize_into_cache)."""
    return Path(cache_dir) / f"chat-{_cache_key(cfg, path, encoder, seed)}.npz"


def _cache_key(cfg: DataConfig, path: Path, encoder: ChatEncoder, seed: int) -> str:
    """Everything that changes the tokenized result. The file is identified by size + mtime, not content:
    hashing 125 MB on every start would cost more than the cache saves on small runs."""
    st = path.stat()
    tok = encoder.tokenizer
    parts = [CACHE_VERSION, str(path.resolve()), st.st_size, st.st_mtime_ns, tok.name_or_path, len(tok),
             _tokenizer_fingerprint(tok), sorted(encoder.special_ids),
             encoder.template, cfg.max_length, cfg.max_samples, cfg.heldout_fraction, cfg.heldout_max, seed]
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:20]


def _tokenizer_fingerprint(tok) -> str:
    """sha1 of the fast tokenizer's own definition (added tokens, normalizer, pre-tokenizer, model: vocabulary and
    merges), so that a tokenizer replaced at the same path is not served another's ids. Its truncation and padding
    settings, which serialise before "added_tokens" and which a call may change, are left out (14 ms for SmolLM2's)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: its vocabulary, added tokens included
        return hashlib.sha1(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()
    text = backend.to_str()
    return hashlib.sha1(text[max(text.find('"added_tokens":'), 0):].encode()).hexdigest()


def _flatten(samples: list[Sample]) -> dict[str, np.ndarray]:
    lens = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    ids = np.fromiter(chain.from_iterable(s.input_ids for s in samples), dtype=np.int32, count=int(lens.sum()))
    mask = np.fromiter(chain.from_iterable(s.loss_mask for s in samples), dtype=bool, count=int(lens.sum()))
    return {"ids": ids, "mask": mask, "lens": lens}


def _unflatten(ids: np.ndarray, mask: np.ndarray, lens: np.ndarray) -> list[Sample]:
    """The samples of a cache file. Built with the cyclic garbage collector paused: the new lists and Samples hold no
    cycles, yet each full collection their growth sets off would walk every list element so far (99,000 samples of
    27 M tokens on the 2-core dev box: 2.0-2.5 s a load against 4.4-4.5, `benchmarks/cache_load_cpu.py`)."""
    with _collector_paused():
        ids_l, mask_l = ids.tolist(), mask.tolist()  # one conversion, then cheap list slices
        bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
        return [Sample(ids_l[a:b], mask_l[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (process-wide), back on after it if it was on. For
    building data that hold no reference cycles: tokenizing 17,350 ShareGPT conversations with one worker cost the
    reading process 1.77-1.87 s of CPU with it paused against 2.11-2.41 s (dev box, two runs each way,
    `benchmarks/tokenize_cpu.py ... 17350 1` with COLLECTOR=running for the latter): the share of a reader that feeds
    many workers."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _save_cache(split: DatasetSplit, cache_path: Path) -> None:
    """Atomic: written to a temporary file in the same directory, then renamed, so a crash or a concurrent run
    never leaves a half-written cache that a later run would trust."""
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{name}_{k}": v for name in ("train", "heldout")
              for k, v in _flatten(getattr(split, name)).items()}
    meta = json.dumps({"stats": split.stats, "heldout_messages": split.heldout_messages,
                       "heldout_keys": split.heldout_keys})
    fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=cache_path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(meta), **arrays)
        os.replace(tmp, cache_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cache(cache_path: Path) -> DatasetSplit:
    with np.load(cache_path) as z:
        meta = json.loads(str(z["meta"]))
        train, heldout = (_unflatten(z[f"{n}_ids"], z[f"{n}_mask"], z[f"{n}_lens"]) for n in ("train", "heldout"))
    return DatasetSplit(train=train, heldout=heldout, heldout_messages=meta["heldout_messages"],
                        stats=dict(meta["stats"], cache_path=str(cache_path)),
                        heldout_keys=meta.get("heldout_keys", []))  # caches written before keys were kept: none


def _log_summary(stats: dict, seconds: float) -> None:
    tokens, loss = stats["train_tokens"], stats["train_loss_tokens"]
    skipped = ", ".join(f"{k}={n}" for k, n in stats["skipped"].items()) or "none"
    log.info("chat data %s: %d conversations read -> %d train / %d held-out samples, %.2fM train tokens "
             "(%.0f%% in the loss), %d at max_length %d; skipped: %s; cache %s; %.1fs",
             stats["source"], stats["conversations"], stats["train"], stats["heldout"], tokens / 1e6,
             100 * loss / max(tokens, 1), stats["at_max_length"], stats["max_length"], skipped, stats["cache"], seconds)
    if stats.get("key_collision"):  # kept in the cache's stats: said again on a cache hit
        log.warning(f"chat data {stats['source']}: {stats['key_collision']}")
