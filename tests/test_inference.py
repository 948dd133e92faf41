"""Speculative decoding: lossless greedy, exact caches, acceptance-rule statistics, stop rules, eval CLI errors;
batched generation (windows, reused caches, length-sorted regeneration pools).

References here are deliberately naive: greedy decoding re-runs the whole sequence every token (no cache), and the
drafter reference recomputes all context features from scratch for every block.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from conftest import make_tiny_target
from dflash_train.cli import main
from dflash_train.config import ModelConfig
from dflash_train.generation.regenerate import RegenerateSettings, RegenerateStats, Regenerator
from dflash_train.data.sources import Conversation
from dflash_train.inference.baseline import BatchGenerator, generate_batch, target_generate
from dflash_train.inference.benchmark import ModelMismatchError, evaluate
from dflash_train.inference.drafter_runner import DrafterRunner
from dflash_train.inference.speculative import accept_sampled, speculative_generate
from dflash_train.inference.target_runner import TargetRunner
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import save_drafter
from dflash_train.models.target import load_target, target_config_info
from dflash_train.training.objective import sdpa_attend

LAYERS = [1, 2]
V = 128  # tiny target vocabulary; the mask token is V - 1


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread


def make_drafter(path, block_size: int, seed: int = 0, layers=LAYERS, mask=V - 1):
    torch.manual_seed(seed)
    cfg = ModelConfig(target_layer_ids=list(layers), mask_token_id=mask, block_size=block_size, num_draft_layers=1)
    return build_drafter(cfg, target_config_info(path))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tiny_llama, tiny_qwen3):
    path = {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]
    return path, load_target(path, LAYERS, truncate=False)


@torch.no_grad()
def naive_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Obviously correct: full forward over the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(target.hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


class ScriptedDrafter:
    """Test double with the DraftSource interface: proposes the known continuation `sequence` (prompt + target
    greedy tokens). p_correct < 1 corrupts each proposal independently; wrong=True corrupts all of them."""

    def __init__(self, sequence: list[int], block_size: int, p_correct: float = 1.0, wrong: bool = False,
                 seed: int = 0, inner=None):
        self.sequence, self.block_size, self.p, self.wrong = sequence, block_size, p_correct, wrong
        self.rng = random.Random(seed)
        self.inner, self.records = inner, []  # optional real DrafterRunner exercised alongside

    def begin(self, prompt_feats):
        if self.inner:
            self.inner.begin(prompt_feats)

    def extend(self, block_feats, block_start):
        if self.inner:
            self.inner.extend(block_feats, block_start)

    def draft(self, last_token, start):
        if self.inner:
            self.records.append((int(last_token), start, self.inner.draft(last_token, start).clone()))
        logits = torch.zeros(self.block_size - 1, V)
        for k in range(1, self.block_size):
            pos = start + k
            tok = self.sequence[pos] if pos < len(self.sequence) else 0
            if self.wrong or self.rng.random() > self.p:
                tok = (tok + 1) % V
            logits[k - 1, tok] = 1.0
        return logits


def runners(target, drafter, block_size, max_len=256):
    t_run = TargetRunner.for_target(target, max_len, step_lens=(1, block_size))
    d_run = DrafterRunner(drafter, target, max_len, block_size) if drafter is not None else None
    return t_run, d_run


# ------------------------------------------------------------------------------------------ greedy: lossless

@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_speculative_equals_target_greedy(target, block_size):
    path, t = target
    t_run, d_run = runners(t, make_drafter(path, block_size), block_size)
    g = torch.Generator().manual_seed(block_size)
    for i, length in enumerate([1, 1, 3, 9, 17, 30]):
        prompt = torch.randint(0, V - 1, (length,), generator=g).tolist()
        n = 23 + i
        base = target_generate(t_run, prompt, n)
        if i < 2:  # pin the cached baseline itself to the naive reference
            assert base.tokens == naive_greedy(t, prompt, n)
        assert speculative_generate(t_run, d_run, prompt, n).tokens == base.tokens
        # partial acceptances of every length exercise the cache crop and the multi-row context extension
        noisy = ScriptedDrafter(prompt + naive_greedy(t, prompt, n + block_size), block_size, p_correct=0.8, seed=i)
        spec = speculative_generate(t_run, noisy, prompt, n)
        assert spec.tokens == base.tokens
        assert len(spec.tokens) == n


def test_drafter_cache_matches_uncached_reference(target):
    """The runner's cached context K/V (extended by accepted rows only) gives the logits of a from-scratch pass."""
    path, t = target
    B = 4
    drafter = make_drafter(path, B, seed=3)
    t_run, d_run = runners(t, drafter, B)
    prompt = [5, 17, 33, 2, 90]
    cont = naive_greedy(t, prompt, 40)
    spy = ScriptedDrafter(prompt + cont, B, p_correct=0.7, seed=1, inner=d_run)
    out = speculative_generate(t_run, spy, prompt, 30).tokens
    seq = prompt + out
    feats = t.features(torch.tensor(seq), torch.arange(len(seq)), torch.zeros(len(seq), dtype=torch.long))
    assert len(spy.records) > 3 and any(a > 1 for a in speculative_generate(t_run, spy, prompt, 30).accept_lengths)
    for last, start, logits in spy.records[:8]:
        assert seq[start] == last
        block = torch.tensor([last] + [drafter.config.mask_token_id] * (B - 1))
        with torch.no_grad():
            h = drafter(t.embed_tokens(block), torch.arange(start, start + B), feats[:start], torch.arange(start),
                        sdpa_attend(torch.ones(B, start + B, dtype=torch.bool)))
            ref = t.lm_head(h[1:])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_training_layout_drafts_what_inference_drafts(target, attention):
    """The training objective's one-pass forward over many anchors of a packed row (objective.draft_hidden: block
    layout, block mask, RoPE positions, context strictly before each anchor) gives, at every anchor that speculative
    decoding visited, the logits of that decoding step's draft. Training and serving compute the same function."""
    from dflash_train.training.objective import draft_hidden

    path, t = target
    B = 4
    drafter = make_drafter(path, B, seed=5)
    t_run, d_run = runners(t, drafter, B)
    prompt = [7, 3, 19, 44, 2, 61]
    spy = ScriptedDrafter(prompt + naive_greedy(t, prompt, 60), B, p_correct=0.7, seed=2, inner=d_run)
    seq = prompt + speculative_generate(t_run, spy, prompt, 40).tokens
    steps = [(start, logits) for _last, start, logits in spy.records if start + B <= len(seq)]
    assert len(steps) > 8 and len({s for s, _ in steps}) == len(steps)
    T = len(seq)
    ids, pos, docs = torch.tensor(seq), torch.arange(T), torch.zeros(T, dtype=torch.long)
    feats = t.features(ids, pos, docs)
    anchors = torch.tensor([s for s, _ in steps])
    supervised = pos >= len(prompt)
    with torch.no_grad():
        h, lay = draft_hidden(drafter, t.embed_tokens.weight, feats, ids, pos, docs, supervised, anchors,
                              torch.ones(len(steps), dtype=torch.bool), block_size=B, attention=attention)
        trained = t.lm_head(h)                                                    # [A, B-1, V]
    assert lay.valid.all()
    for i, (_start, logits) in enumerate(steps):
        torch.testing.assert_close(trained[i], logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(trained.argmax(-1), torch.stack([lg.argmax(-1) for _, lg in steps]))


def test_oracle_reaches_tau_block_size_and_wrong_drafter_gets_one(tiny_llama):
    t = load_target(tiny_llama, LAYERS, truncate=False)
    B = 4
    t_run, _ = runners(t, None, B)
    prompt = [11, 12, 13]
    steps = 5
    n = 1 + steps * B                    # the first token comes from prefill, then B per step
    cont = naive_greedy(t, prompt, n + B)
    oracle = speculative_generate(t_run, ScriptedDrafter(prompt + cont, B), prompt, n)
    assert oracle.accept_lengths == [B] * steps and oracle.tau == B
    assert oracle.tokens == cont[:n]
    wrong = speculative_generate(t_run, ScriptedDrafter(prompt + cont, B, wrong=True), prompt, n)
    assert wrong.accept_lengths == [1] * (n - 1) and wrong.tau == 1
    assert wrong.tokens == cont[:n]


def test_max_new_tokens_and_eos_mid_block(tiny_llama):
    t = load_target(tiny_llama, LAYERS, truncate=False)
    B = 8
    t_run, _ = runners(t, None, B)
    prompt = [40, 41, 42, 43]
    cont = naive_greedy(t, prompt, 60)
    oracle = ScriptedDrafter(prompt + cont, B)
    for n in (1, 2, B - 3, B + 3, 2 * B + 5):   # limits that fall inside an accepted block
        assert speculative_generate(t_run, oracle, prompt, n).tokens == cont[:n]
    # An eos the continuation really produces, first seen inside an accepted block (blocks cover 1..B, B+1..2B, ...)
    first = {}
    for i, tok in enumerate(cont):
        first.setdefault(tok, i)
    mid = [(i, tok) for tok, i in first.items() if i >= 2 and i % B not in (0, 1)]
    assert mid, "the tiny target's continuation has no usable stop token"
    i, eos = mid[0]
    base = target_generate(t_run, prompt, 50, stop_ids=[eos])
    spec = speculative_generate(t_run, oracle, prompt, 50, stop_ids=[eos])
    assert base.tokens == spec.tokens == cont[: i + 1]


@pytest.mark.parametrize("q", [1, 4, 16, 200])
def test_packed_gqa_attention_equals_hf_sdpa(q):
    """Query heads packed as rows of their K/V head == HF's SDPA with repeat_kv (bool and additive masks); many rows
    (prefill) go to HF's function itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash_train.inference.attention import packed_gqa_attention

    class Layer:
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(q)
    b, H, Hkv, L, d = 3, 9, 3, 40 + q, 16
    query, key, value = (torch.randn(b, h, n, d, generator=g) for h, n in ((H, q), (Hkv, L), (Hkv, L)))
    mask = torch.rand(b, 1, q, L, generator=g) > 0.3
    mask[..., 0] = True
    for m in (mask, torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))):
        ref, _ = sdpa_attention_forward(Layer(), query, key, value, m, scaling=0.25)
        out, _ = packed_gqa_attention(Layer(), query, key, value, m, scaling=0.25)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("q_rows", [1, 3])
def test_row_length_attention_reads_each_rows_own_tiles(q_rows):
    """The flex decode's BlockMask: row r attends to slots 0..ends[r] (tile counts ceil((ends + 1) / tile), none for
    an ended row, whose output is zero), equal to masked SDPA over the same slots, and the K/V it counts as read;
    with q_rows = H / H_kv (what the engine builds) the query heads of a K/V head attend as rows of that head."""
    import torch.nn.functional as F

    from dflash_train.inference.attention import RowLengthMask, row_length_attention

    g = torch.Generator().manual_seed(0)
    b, H, Hkv, d, L, tile = 6, 6, 2, 16, 40, 8
    query, key, value = (torch.randn(b, h, n, d, generator=g) for h, n in ((H, 1), (Hkv, L), (Hkv, L)))
    ends = torch.tensor([0, 7, 8, 20, 39, 5, 0])  # one row more than stepped, as the engine's spare row
    done = torch.tensor([False, False, False, False, False, True, False])
    rows = RowLengthMask(ends, done, L, tile=tile, q_rows=q_rows)
    mask = rows.block_mask(b)
    assert mask.kv_num_blocks.flatten().tolist() == [1, 1, 2, 3, 5, 0] and mask.seq_lengths == (q_rows, L)
    out, _ = row_length_attention(None, query, key, value, mask, scaling=0.25)
    visible = (torch.arange(L)[None] <= ends[:b, None])[:, None, None]
    ref = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1),
                                         attn_mask=visible, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out[:5], ref[:5], atol=1e-6, rtol=1e-6)
    assert (out[5] == 0).all()
    assert rows.slots_read([0, 7, 8, 39]) == 8 + 8 + 16 + 40  # whole tiles, the last one cut at the slots


def test_runners_switch_sdpa_models_to_packed_gqa_only(tiny_qwen3):
    from dflash_train.inference.attention import NAME

    t = load_target(tiny_qwen3, LAYERS, truncate=False)
    TargetRunner.for_target(t, 64, step_lens=(1, 4))
    assert t.hf.config._attn_implementation == NAME and t.attention == "sdpa"
    BatchGenerator(t.hf, 2, 64, packed_gqa=False)
    assert t.hf.config._attn_implementation == "sdpa"
    flex = load_target(tiny_qwen3, LAYERS, truncate=False, attention="flex")
    BatchGenerator(flex.hf, 2, 64)
    assert flex.hf.config._attn_implementation == "flex_attention"   # left as it is


def test_generate_batch_matches_single_prompt_greedy(tiny_qwen3):
    t = load_target(tiny_qwen3, LAYERS, truncate=False)
    prompts = [[3], [7, 8, 9, 10, 11, 12], [20, 21, 22]]
    refs = [naive_greedy(t, p, 12) for p in prompts]
    assert generate_batch(t.hf, prompts, 12) == refs
    eos = refs[1][4]
    cut = generate_batch(t.hf, prompts, 12, eos_ids=[eos])
    for ref, got in zip(refs, cut):
        assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)


@pytest.mark.parametrize("kv_window", [None, 4])
def test_batch_generator_reused_across_batches_matches_greedy(tiny_qwen3, kv_window):
    """One generator (cache of 40 slots) serves batches of different lengths and sizes; with a 4-slot window the
    decode steps cross many windows (each its own step) and the prefill attends over its own slots only."""
    t = load_target(tiny_qwen3, LAYERS, truncate=False)
    gen = BatchGenerator(t.hf, 3, 40, kv_window=kv_window)
    batches = [[[3], [7, 8, 9, 10, 11, 12], [20, 21, 22]], [[5, 6], [9]], [[1, 2] * 9, [4] * 5, [6]]]
    for prompts in batches:
        assert gen.generate(prompts, 13) == [naive_greedy(t, p, 13) for p in prompts]
    if kv_window:
        assert {v for _, v in gen.runner._steps} == set(range(4, 33, 4))  # windows of 4 slots up to 18 + 13


class CharTokenizer:
    """Just enough of a HF tokenizer for regeneration: a chat template, ids from characters, decode to text."""
    chat_template = "stub"
    pad_token_id = 0
    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(str(t) for t in tokens)


def test_length_sorted_pools_keep_every_reply_and_cut_padding(tiny_llama, monkeypatch):
    """Sorting a pool by prompt length changes which prompts share a prefill and the rows beside them, not what the
    target answers: every conversation (multi-turn ones turn by turn) gets the same records as in arrival order,
    with less prefill padding."""
    from dflash_train.generation.engine import Engine

    hf = load_target(tiny_llama, LAYERS, truncate=False).hf
    convs = []
    for i, n in enumerate([3, 40, 5, 60, 4, 8, 50, 6, 7, 45, 2, 9]):
        msgs = [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "old answer"}]
        if i % 4 == 0:  # a second turn: generated after the first reply, from a history holding it
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "old"}]
        convs.append((f"c{i}_0", Conversation(f"c{i}", msgs), True))
    settings = RegenerateSettings("test", "tiny", max_new_tokens=5, temperature=0.0, single_turn=False,
                                  max_length=256)
    padding = Counter()
    prefill = Engine._prefill

    def spy(self, rows, reqs, stats):
        padding[lookahead] += sum(max(len(r.prompt_ids) for r in reqs) - len(r.prompt_ids) for r in reqs)
        return prefill(self, rows, reqs, stats)

    monkeypatch.setattr(Engine, "_prefill", spy)

    class Bar:
        def update(self, n=1): ...
        def set_postfix_str(self, *a, **k): ...

    records = {}
    for lookahead in (1, 4):
        out: list[dict] = []
        stats = RegenerateStats()
        Regenerator(hf, CharTokenizer(), settings, 3, stop_ids=[], lookahead=lookahead).run(
            iter(convs), out.append, lambda: None, stats, Bar())
        assert stats.turns == len(convs) + 3 and stats.conversations == len(convs)
        records[lookahead] = {r["id"]: r["messages"] for r in out}
    assert records[1] == records[4] and len(records[1]) == len(convs)
    assert padding[4] < padding[1] / 3, padding


# ------------------------------------------------------------------------------------------ sampling

def test_accept_sampled_preserves_target_distribution():
    """Speculative sampling: the first emitted token ~ p_1, and after an accepted d_1 the second ~ p_2."""
    torch.manual_seed(0)
    Vs, B, T = 6, 3, 1.0
    target_logits = torch.randn(B, Vs) * 1.5
    q_logits = torch.randn(B - 1, Vs) * 1.5
    p = torch.softmax(target_logits, -1)
    q = torch.softmax(q_logits, -1)
    g = torch.Generator().manual_seed(1)
    N = 10000
    first, second = torch.zeros(Vs), torch.zeros(Vs)
    for _ in range(N):
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        n, emitted, last = accept_sampled(target_logits, draft, q, T, g)
        assert int(last) == emitted[-1] and len(emitted) == n + 1
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    tv1 = 0.5 * (first / N - p[0]).abs().sum()
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum()
    assert tv1 < 0.03 and tv2 < 0.04, (tv1, tv2)
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.15   # the proposal really differs: the test can fail


def test_sampled_speculative_matches_target_distribution(tmp_path):
    """End to end on an 8-token vocabulary: the 2nd and 3rd generated tokens (drafted and verified in one step)
    follow the target's exact marginals, while the drafter's own proposals clearly do not."""
    Vs, B, T = 8, 4, 1.0
    # initializer_range 0.06: peaked enough that drafts are often rejected, flat enough that some blocks pass
    path = make_tiny_target(tmp_path / "t8", "llama", vocab_size=Vs, initializer_range=0.06)
    t = load_target(path, LAYERS, truncate=False)
    t_run, d_run = runners(t, make_drafter(path, B, mask=Vs - 1), B, max_len=32)
    prompt = [3, 1, 4]
    g = torch.Generator().manual_seed(0)
    N = 1000
    counts, taus = torch.zeros(2, Vs), torch.zeros(B + 1)
    for _ in range(N):
        out = speculative_generate(t_run, d_run, prompt, 3, temperature=T, generator=g)
        assert len(out.tokens) == 3 and all(0 <= x < Vs for x in out.tokens)
        counts[0, out.tokens[1]] += 1
        counts[1, out.tokens[2]] += 1
        taus[out.accept_lengths[0]] += 1
    assert taus[1] > 50 and taus[B] > 50          # both the rejection and the all-accepted paths ran
    with torch.no_grad():  # exact marginals by enumerating t1 (and t2)
        p1 = torch.softmax(t.hf(input_ids=torch.tensor([prompt])).logits[0, -1] / T, -1)
        seq2 = torch.tensor([prompt + [a] for a in range(Vs)])
        p2 = torch.softmax(t.hf(input_ids=seq2).logits[:, -1] / T, -1)                    # [t1, t2]
        joint12 = p1[:, None] * p2
        seq3 = torch.tensor([prompt + [a, b] for a in range(Vs) for b in range(Vs)])
        p3 = torch.softmax(t.hf(input_ids=seq3).logits[:, -1] / T, -1).view(Vs, Vs, Vs)   # [t1, t2, t3]
        m2, m3 = joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))
    tv = [float(0.5 * (counts[0] / N - m2).abs().sum()), float(0.5 * (counts[1] / N - m3).abs().sum())]
    assert max(tv) < 0.06, tv


# ------------------------------------------------------------------------------------------ eval CLI

@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("eval")
    drafter_dir = save_drafter(make_drafter(tiny_llama, 4), root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": p}) for p in ([1], [5, 6, 7], [9] * 12)) + "\n")
    return root, tiny_llama, str(drafter_dir), str(prompts)


def test_eval_cli_writes_report(eval_setup, capsys):
    root, target, drafter, prompts = eval_setup
    out = root / "out"
    rc = main(["eval", "--drafter", drafter, "--target", target, "--prompts", prompts, "--max-new-tokens", "20",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "eval.json").read_text())
    s = report["summary"]
    assert s["lossless"] is True and s["num_prompts"] == 3 and s["block_size"] == 4 and s["dtype"] == "fp32"
    assert sum(s["accept_histogram"]) == s["steps"] > 0 and 1 <= s["mean_tau"] <= 4
    assert len(s["acceptance_by_position"]) == 3 and s["speedup"] > 0
    assert all(p["baseline"] == p["speculative"] for p in report["prompts"])
    # training's acc@k estimate on the same outputs, per prompt and as the mean over prompts
    estimates = [p["tau_estimate"] for p in report["prompts"]]
    assert all(1 <= e <= 4 for e in estimates) and s["tau_estimate"] == pytest.approx(sum(estimates) / 3)
    assert (out / "eval.png").stat().st_size > 1000
    console = capsys.readouterr().out
    assert "lossless" in console and "tau estimate (acc@k)" in console


def test_eval_cli_dtype_sets_and_states_the_compute_dtype(eval_setup, capsys):
    """--dtype bf16 runs target and drafter in bf16 (here on CPU) and says so in eval.json and on the console; the
    verdict is not asserted: in bf16 near-ties may legitimately round differently (inference/benchmark.py)."""
    root, target, drafter, prompts = eval_setup
    out = root / "bf16"
    assert main(["eval", "--drafter", drafter, "--target", target, "--prompts", prompts, "--max-new-tokens", "8",
                 "--device", "cpu", "--dtype", "bf16", "--out", str(out)]) == 0
    assert json.loads((out / "eval.json").read_text())["summary"]["dtype"] == "bf16"
    assert "cpu, bf16, cuda graphs off" in capsys.readouterr().out


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], err[0]


@pytest.mark.parametrize("case, needle", [
    ("hidden", "hidden size"), ("vocab", "vocabulary size"), ("layers", "do not exist"),
])
def test_eval_cli_mismatched_drafter_is_one_clear_error(eval_setup, tmp_path, capsys, case, needle):
    _, target, _, prompts = eval_setup
    other = {"hidden": dict(hidden_size=32, intermediate_size=64), "vocab": dict(vocab_size=96),
             "layers": dict(num_hidden_layers=8)}[case]
    other_target = make_tiny_target(tmp_path / "other", "llama", **other)
    layers = [1, 6] if case == "layers" else LAYERS
    d = save_drafter(make_drafter(other_target, 4, layers=layers, mask=other.get("vocab_size", V) - 1),
                     tmp_path / "d")
    capsys.readouterr()  # drop the progress bars of saving the other target
    assert main(["eval", "--drafter", str(d), "--target", target, "--prompts", prompts, "--device", "cpu"]) == 2
    _one_error_line(capsys, needle)


def test_eval_cli_bad_prompts_are_one_clear_error(eval_setup, capsys):
    root, target, drafter, _ = eval_setup
    empty = root / "empty.jsonl"
    empty.write_text("\n")
    args = ["eval", "--drafter", drafter, "--target", target, "--device", "cpu", "--prompts"]
    assert main(args + [str(empty)]) == 2
    _one_error_line(capsys, "has no prompts")
    long = root / "long.jsonl"
    long.write_text(json.dumps({"input_ids": [3] * 600}) + "\n")   # tiny target context: 512
    assert main(args + [str(long)]) == 2
    _one_error_line(capsys, "exceeds the target's context of 512")
    bad = root / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    assert main(args + [str(bad)]) == 2
    _one_error_line(capsys, "bad.jsonl:1")


def test_mean_tau_standard_error_over_prompts():
    """The report's standard error of mean tau is the sample standard deviation of the per-prompt taus over
    sqrt(prompts); prompts without a step are left out, and one prompt has none."""
    import statistics

    from dflash_train.inference.benchmark import EvalReport, PromptReport
    from dflash_train.inference.report import format_summary

    steps = [[1, 3], [4, 4, 4], [2], []]   # taus 2, 4, 2 and one prompt done at its first token
    rep = EvalReport(4, 0.0, 8, "cpu", False, prompts=[PromptReport(3, [], [], a, 0.1, 0.1) for a in steps])
    assert rep.mean_tau_se == pytest.approx(statistics.stdev([2, 4, 2]) / 3 ** 0.5)
    assert rep.summary()["mean_tau_se"] == rep.mean_tau_se
    assert f"± {rep.mean_tau_se:.2f} (standard error over prompts)" in format_summary(rep)
    assert EvalReport(4, 0.0, 8, "cpu", False, prompts=[PromptReport(3, [], [], [2], 0.1, 0.1)]).mean_tau_se is None


def test_evaluate_api_with_oracle(tiny_llama):
    t = load_target(tiny_llama, LAYERS, truncate=False)
    prompt = [7, 7, 8]
    cont = naive_greedy(t, prompt, 30)
    rep = evaluate(t, ScriptedDrafter(prompt + cont, 4), [prompt], 13, block_size=4)
    s = rep.summary()
    assert s["lossless"] and s["mean_tau"] == 4 and s["accept_histogram"] == [0, 0, 0, 3]
    assert s["acceptance_by_position"] == [1.0, 1.0, 1.0] and s["conditional_acceptance"] == [1.0, 1.0, 1.0]


def test_evaluate_rejects_truncated_target_and_other_taps(tiny_llama):
    drafter = make_drafter(tiny_llama, 4)
    with pytest.raises(ValueError, match="truncate=False"):
        evaluate(load_target(tiny_llama, LAYERS, truncate=True), drafter, [[1, 2]], 4)
    with pytest.raises(ModelMismatchError, match="reads target layers"):
        evaluate(load_target(tiny_llama, [0, 3], truncate=False), drafter, [[1, 2]], 4)


# ------------------------------------------------------------------------------------------ real SmolLM2

@pytest.mark.slow
def test_eval_on_smollm2_random_drafter_is_lossless(smollm2_dir):
    """The real SmolLM2 (the embedded GGUF, converted once) with a random drafter: chat-template prompts, greedy,
    lossless. The CLI path is covered on the tiny target."""
    from dflash_train.inference.benchmark import stop_token_ids
    from dflash_train.inference.prompts import Prompt, tokenize_prompts
    from dflash_train.models.target import default_layer_ids, load_tokenizer

    t = load_target(str(smollm2_dir), default_layer_ids(30, 5), truncate=False)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(target_layer_ids=t.layer_ids, block_size=4, num_draft_layers=1,
                                        mask_token_id=t.info.vocab_size - 1), t.info)
    tok = load_tokenizer(str(smollm2_dir))
    prompts = tokenize_prompts([Prompt("messages", [{"role": "user", "content": "What is 2 + 2?"}]),
                                Prompt("text", "The capital of France is")], tok)
    assert prompts[0][-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    rep = evaluate(t, drafter, prompts, 12, stop_ids=stop_token_ids(t.hf, tok))
    s = rep.summary()
    assert s["lossless"] is True and s["num_prompts"] == 2 and s["steps"] > 0
