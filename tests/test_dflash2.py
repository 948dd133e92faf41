"""DFlash 2 drafters: the export loads into the reference DFlash2DraftModel (PyPI `dflash`, a test dependency) key for
key and computes what ours does in fp32; the reference's dflash_generate with our drafter is the target's greedy
output; the block-causal convolution against a naive per-position loop; config checks; the step's FLOP formula
(v1 and v2) against a direct count.
"""

from __future__ import annotations

import json
import re
import time

import dflash.model as ref_dflash  # installed by .ci/run (pip install --no-deps dflash==0.1.0): never skipped
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from transformers import Qwen3Config

from conftest import make_tiny_target
from dflash_train.config import ConfigError, load_config
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import (CheckpointError, drafter_config_json, load_drafter, load_drafter_config,
                                           save_drafter, serve_commands)
from dflash_train.data.packing import sample_anchors
from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.models.drafter2 import DFlash2Drafter, Drafter2Config, DynamicCausalConv
from dflash_train.models.target import target_config_info
from dflash_train.training.flops import drafter_step_flops
from dflash_train.training.objective import dflash_loss, draft_hidden, sdpa_attend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

B = 4          # block size of the test drafters
N_NEW = 40     # tokens generated in the generation tests
H, V = 64, 128


def make_drafter2(target, *over, seed: int = 0, jitter: float = 0.1) -> DFlash2Drafter:
    """A DFlash 2 drafter for `target` whose convolutions are not at their identity init (jitter added to every
    parameter) and whose selector's pairwise term is as large as the logits (codebooks and projection of std 1), so
    that every new parameter, and the predecessor above all, matters in a comparison."""
    cfg = load_config(None, [f"model.target={target}", "model.num_draft_layers=2", "model.mask_token_id=127",
                             f"model.block_size={B}", "model.target_layer_ids=[1,2]", "model.architecture=dflash2",
                             "model.selector_top_k=8", "model.selector_rank=12", "model.conv_kernel_size=3",
                             *over])
    torch.manual_seed(seed)
    drafter = build_drafter(cfg.model, target_config_info(target))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * jitter)
        sel = drafter.candidate_selector
        for w in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            w.normal_(std=1.0)
    return drafter


def coin_drafter(drafter: DFlash2Drafter) -> DFlash2Drafter:
    """Final norm gain on hidden unit 0 only: with the biased target's head the drafter's top candidate is token 0 or
    1 (the sign of that unit), far above the rest; drafts are then sometimes accepted, sometimes not."""
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
    return drafter


# ------------------------------------------------------------------------------------------ the model itself

def naive_conv(x, dyn, base, group_size):
    """y[t] = sum_o (base[o] + dyn[t, o, group]) * x[t - o], per position and channel, one block: obviously right."""
    T, Hs = x.shape
    y = torch.zeros_like(x)
    for t in range(T):
        for o in range(base.shape[0]):
            if t - o >= 0:
                for c in range(Hs):
                    y[t, c] += (base[o, c] + dyn[t, o, c // group_size]) * x[t - o, c]
    return y


def test_block_causal_convolution_equals_per_position_loop():
    torch.manual_seed(0)
    conv = DynamicCausalConv(32, kernel_size=3, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_()
    x, dyn = torch.randn(3 * 5, 32), torch.randn(3 * 5, 3, 4)
    got = conv._convolve(x, dyn, conv.base_kernel[0], block_size=5)
    for b in range(3):  # each block alone: nothing crosses a block boundary
        rows = slice(5 * b, 5 * b + 5)
        torch.testing.assert_close(got[rows], naive_conv(x[rows], dyn[rows], conv.base_kernel[0], 8))


def test_fresh_dflash2_layers_compute_what_dflash_layers_do(tiny_llama):
    """Identity init of the convolutions: a fresh DFlash 2 drafter with the v1 drafter's weights is the v1 drafter."""

    fresh = make_drafter2(tiny_llama, jitter=0.0)
    v1 = DFlashDrafter(fresh.config)
    missing, unexpected = v1.load_state_dict(fresh.state_dict(), strict=False)
    assert not missing and unexpected and all("conv" in k or "selector" in k for k in unexpected)
    S = 6
    feats, x = torch.randn(S, 2 * H), torch.randn(2 * B, H)
    attend = sdpa_attend(torch.ones(2 * B, S + 2 * B, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, torch.arange(S, S + 2 * B), feats, torch.arange(S), attend),
                                   v1(x, torch.arange(S, S + 2 * B), feats, torch.arange(S), attend))


# ------------------------------------------------------------------------------------------ export vs the reference

def test_export_loads_into_reference_key_for_key_and_matches_fp32(tiny_qwen3, tmp_path):
    drafter = make_drafter2(tiny_qwen3)
    out = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["is_causal"] is False
    assert conf["dflash_config"] | {} == {"target_layer_ids": [1, 2], "mask_token_id": 127, "block_size": B,
                                         "conv_kernel_size": 3, "conv_group_size": 16, "selector_top_k": 8,
                                         "selector_rank": 12}
    ref, info = ref_dflash.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref_state = ref.state_dict()
    ours = drafter.state_dict()
    for k, v in ours.items():  # every value arrived (the codebooks through the reference's key mapping)
        rk = k + ".weight" if k.endswith("_codebook") else k
        assert torch.equal(ref_state[rk], v), k
    assert len(ref_state) == len(ours)
    # The same function: one block after S context tokens.
    S = 7
    feats, x, pos = torch.randn(1, S, 2 * H), torch.randn(1, B, H), torch.arange(S + B)[None]
    with torch.no_grad():
        want = drafter(x[0], pos[0, S:], feats[0], pos[0, :S], sdpa_attend(torch.ones(B, S + B, dtype=torch.bool)))
        got = ref(position_ids=pos, noise_embedding=x, target_hidden=feats)[0]
        torch.testing.assert_close(got, want)
        # The same drafts: the selector's left-to-right choice among the top-k of the same logits.
        logits = torch.randn(B - 1, V) * 3
        anchor = torch.tensor([11])
        ours_drafts, ours_cand, _ = drafter.candidate_selector.select(want[1:], logits, anchor)
        ref_drafts, _, _ = ref.candidate_selector.select(want[None, 1:], logits[None], anchor, 0.0)
        assert ours_drafts.tolist() == ref_drafts[0].tolist()
        # At a temperature: the same distribution over the same candidates, given the same earlier drafts.
        torch.manual_seed(3)
        d_t, cand_t, q_t = drafter.candidate_selector.select(want[1:], logits, anchor, temperature=0.7)
        prev = torch.cat([anchor, d_t[:-1]])
        for k in range(B - 1):
            s = ref.candidate_selector
            unary = logits[k, cand_t[k]]
            ref_scores = unary + torch.einsum("r,kr->k", s.predecessor_codebook(prev[k]) * s.hidden_projection(want[k + 1]),
                                              s.successor_codebook(cand_t[k]))
            torch.testing.assert_close(q_t[k], torch.softmax(ref_scores / 0.7, -1))
    back = load_drafter(out)  # and the project reads its own export back
    assert isinstance(back, DFlash2Drafter) and back.config == drafter.config
    for k, v in ours.items():
        assert torch.equal(back.state_dict()[k], v), k


def test_reference_dflash_generate_with_our_drafter_is_target_greedy(biased_llama, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = save_drafter(coin_drafter(make_drafter2(biased_llama)), tmp_path / "d", dtype=torch.float32)
    ref = ref_dflash.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    monkeypatch.setattr(ref_dflash, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA; this is CPU
    steps = []
    for prompt in ([[5, 9, 17, 33, 2, 8]], [[3]], [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]):
        prompt = torch.tensor(prompt)
        greedy = target.generate(prompt, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        spec = ref_dflash.dflash_generate(ref, target, prompt, N_NEW, None, block_size=B, return_stats=True)
        assert spec.output_ids.tolist() == greedy.tolist()
        steps += spec.acceptance_lengths
    assert max(steps) > 1 and min(steps) < B  # drafts accepted and rejected: the cache crops ran


# ------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("over, needle", [
    (["model.architecture=dflash3"], "model.architecture"),
    (["model.conv_kernel_size=5"], "model.conv_kernel_size"),          # > block_size 4
    (["model.selector_top_k=0"], "model.selector_top_k"),
])
def test_bad_dflash2_sizes_are_one_config_error(tiny_llama, over, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [f"model.target={tiny_llama}", "model.block_size=4", "model.architecture=dflash2", *over])


@pytest.mark.parametrize("over, needle", [
    (["model.conv_group_size=24"], "does not divide the target's hidden size 64"),
    (["model.selector_top_k=129"], "exceeds the target vocabulary"),
])
def test_dflash2_sizes_that_do_not_fit_the_target_are_refused(tiny_llama, over, needle):
    with pytest.raises(ConfigError, match=needle):
        make_drafter2(tiny_llama, *over)


@pytest.mark.parametrize("over, odd", [
    ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 8}, [1]),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, [0, 1]),
    ({"layer_types": ["sliding_attention", "full_attention"], "is_causal": None}, [0]),   # causal, no window
    ({"is_causal": True}, [0, 1]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, []),   # no window, is_causal false: full after all
])
def test_sliding_window_or_causal_drafters_are_refused_as_the_reference_reads_them(tmp_path, over, odd):
    """A config.json whose layers the reference attends with a window or causally (given layer_types, or derived
    from use_sliding_window as Qwen3Config does; is_causal) is one CheckpointError naming those layers, on every
    path that reads a drafter directory (drafter_init, eval, resume): our drafters attend fully in every layer."""
    cfg = Drafter2Config(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=V, target_layer_ids=[1, 2],
                         num_target_layers=4, mask_token_id=V - 1, block_size=B)
    d = drafter_config_json(cfg) | over
    ref = ref_dflash.DFlash2DraftModel(Qwen3Config.from_dict(d))
    read = [i for i, layer in enumerate(ref.layers)
            if layer.self_attn.sliding_window is not None or layer.self_attn.is_causal]
    assert read == odd                                       # what the reference would run
    (tmp_path / "config.json").write_text(json.dumps(d))
    if odd:
        with pytest.raises(CheckpointError, match=rf"gives layer\(s\) {re.escape(str(odd))} sliding-window or "):
            load_drafter_config(tmp_path)
    else:
        assert load_drafter_config(tmp_path) == cfg
    (tmp_path / "config.json").write_text(json.dumps(drafter_config_json(cfg)))
    assert load_drafter_config(tmp_path) == cfg                # our own export: full attention, loads


def test_serve_commands_name_dflash2_as_the_engines_do(tiny_llama, tmp_path):
    """SGLang and vLLM serve DFlash 2 under their DFlash names (DFLASH, "dflash"), choosing it from config.json
    (docs/SERVING.md); SGLang is told the block size, which the convolutions depend on; serve.txt names the engine
    changes it needs. A v1 drafter's commands are unchanged."""
    drafter = make_drafter2(tiny_llama)
    v2 = serve_commands(drafter.config, "D", "T").splitlines()
    assert v2 == ["python -m sglang.launch_server --model-path T --dtype bfloat16 --speculative-algorithm DFLASH "
                  f"--speculative-draft-model-path D --speculative-num-draft-tokens {B}",
                  "vllm serve T --dtype bfloat16 --speculative-config "
                  f"'{{\"method\": \"dflash\", \"model\": \"D\", \"num_speculative_tokens\": {B - 1}}}'"]
    v1 = serve_commands(DrafterConfig(**{k: v for k, v in drafter.config.to_dict().items()
                                         if k in DrafterConfig.__dataclass_fields__}), "D", "T").splitlines()
    assert v1 == [v2[0].removesuffix(f" --speculative-num-draft-tokens {B}"), v2[1]]
    serve = (save_drafter(drafter, tmp_path / "d") / "serve.txt").read_text()
    assert "sgl-project/sglang#35371" in serve and "vllm-project/vllm#52816" in serve
    assert serve.endswith(serve_commands(drafter.config))


# ------------------------------------------------------------------------------------------ training vs inference

LAYERS = [1, 2]


def dflash2_decode(t, drafter, prompt, n, temperature=0.0, generator=None, max_len=128):
    from dflash_train.inference.drafter_runner import Drafter2Runner
    from dflash_train.inference.speculative import speculative_generate
    from dflash_train.inference.target_runner import TargetRunner

    t_run = TargetRunner.for_target(t, max_len, step_lens=(1, B))
    d_run = Drafter2Runner(drafter, t, max_len, B)
    return t_run, d_run, speculative_generate(t_run, d_run, prompt, n, temperature, generator=generator)


def test_training_layout_drafts_what_inference_drafts(biased_llama):
    """DFlash 2 decoding (Drafter2Runner: selector left to right on its own drafts) against the training objective's
    one pass over the decoded sequence with an anchor at every step decoding took (teacher-forced selector): each
    block's accept_len in training is the acceptance length decoding got there, and the teacher-forced picks are
    decoding's drafts up to and including its first wrong one."""
    from dflash_train.inference.baseline import target_generate
    from dflash_train.models.target import load_target
    from dflash_train.training.objective import default_gamma

    t = load_target(biased_llama, LAYERS, truncate=False)
    drafter = coin_drafter(make_drafter2(biased_llama, seed=4))
    steps_total, deep = 0, 0
    for prompt in ([5, 9, 17, 33, 2, 8], [40, 41, 42], [7]):
        t_run, d_run, spec = dflash2_decode(t, drafter, prompt, 48)
        assert spec.tokens == target_generate(t_run, prompt, 48).tokens          # lossless
        seq = prompt + spec.tokens
        starts = [len(prompt)]
        for a in spec.accept_lengths[:-1]:
            starts.append(starts[-1] + a)
        keep = [i for i, s in enumerate(starts) if s + B <= len(seq)]             # every label of the block exists
        T = len(seq)
        ids, pos, docs = torch.tensor(seq), torch.arange(T), torch.zeros(T, dtype=torch.long)
        feats = t.features(ids, pos, docs)
        anchors = torch.tensor([starts[i] for i in keep])
        with torch.no_grad():
            out = dflash_loss(drafter, t.embed_tokens.weight, t.lm_head.weight, feats, ids, pos, docs, pos >= len(prompt),
                              anchors, torch.ones(len(keep), dtype=torch.bool), block_size=B, gamma=default_gamma(B))
        assert out["accept_len"].long().tolist() == [spec.accept_lengths[i] for i in keep]
        steps_total += len(keep)
        deep += sum(spec.accept_lengths[i] > 2 for i in keep)
    assert steps_total > 20 and deep > 3  # many steps, some accepted past the first draft (the selector's chain)


def test_training_layout_accepts_every_draft_where_the_sequence_is_decodings_drafts(tiny_llama):
    """Decoding with a random DFlash 2 drafter on a random target (varied tokens, drafts mostly rejected), recorded
    step by step. For each step, the sequence is continued by that step's drafts instead of the target's tokens: the
    training objective's pass over it (features, hidden states, teacher-forced selector) must pick exactly those
    drafts, so its accept_len is B. The hidden states at the real sequence's anchors are decoding's."""
    from dflash_train.inference.speculative import speculative_generate
    from dflash_train.models.target import load_target
    from dflash_train.training.objective import default_gamma, draft_hidden

    t = load_target(tiny_llama, LAYERS, truncate=False)
    drafter = make_drafter2(tiny_llama, seed=5)
    prompt = [3, 14, 15, 92]
    t_run, d_run, _ = dflash2_decode(t, drafter, prompt, 30)
    records, inner = [], d_run.propose

    def spy(last, start, temperature=0.0, generator=None):
        h = d_run.draft(last, start)[0].clone()
        drafts, q = inner(last, start, temperature, generator)
        records.append((int(last), start, h, drafts.clone()))
        return drafts, q

    d_run.propose = spy
    seq = prompt + speculative_generate(t_run, d_run, prompt, 30).tokens
    rec = [r for r in records if r[1] + B <= len(seq)]
    assert len(rec) > 8 and len({tuple(r[3].tolist()) for r in rec}) > 4

    def row(tokens):
        T = len(tokens)
        ids, pos, docs = torch.tensor(tokens), torch.arange(T), torch.zeros(T, dtype=torch.long)
        return t.features(ids, pos, docs), ids, pos, docs, pos >= len(prompt)

    with torch.no_grad():
        feats, ids, pos, docs, sup = row(seq)
        anchors = torch.tensor([r[1] for r in rec])
        h, _ = draft_hidden(drafter, t.embed_tokens.weight, feats, ids, pos, docs, sup, anchors,
                            torch.ones(len(rec), dtype=torch.bool), block_size=B)
        for i, (last, start, h_inf, drafts) in enumerate(rec):
            assert seq[start] == last
            torch.testing.assert_close(h[i], h_inf, atol=1e-4, rtol=1e-4)
            alt = seq[: start + 1] + drafts.tolist()                 # the sequence as this step drafted it
            out = dflash_loss(drafter, t.embed_tokens.weight, t.lm_head.weight, *row(alt), torch.tensor([start]),
                              torch.ones(1, dtype=torch.bool), block_size=B, gamma=default_gamma(B))
            assert out["accept_len"].tolist() == [B], (start, drafts)


def test_selector_loss_trains_the_selector_only_where_the_label_is_a_candidate():
    """The selector term: K-way cross-entropy at positions whose label is among the top-K candidates, zero weight
    elsewhere; the logits are constants (no gradient to the head path from it), the codebooks get gradients."""
    from dflash_train.models.drafter2 import CandidateSelector
    from dflash_train.training.selector import selector_objective

    torch.manual_seed(0)
    A, P, Hs, Vs, K = 3, 4, 8, 20, 5
    sel = CandidateSelector(Vs, Hs, rank=4, top_k=K)
    sel.reset_parameters(std=1.0)  # a pairwise term as large as the logits: the predecessor decides picks
    h = torch.randn(A, P, Hs, requires_grad=True)
    head_w = torch.randn(Vs, Hs)
    block_ids = torch.randint(0, Vs, (A, P + 1))
    logits = (h.detach() @ head_w.t())
    unary, top = logits.topk(K, dim=-1)
    labels = torch.where(torch.rand(A, P) < 0.5, top[..., 2], logits.argmin(-1))   # half in the set, half out
    weights = torch.rand(A, P)
    loss, picks = selector_objective(sel, h, unary, top, block_ids, labels, weights)
    # naive reference, one position at a time
    num, den = 0.0, 0.0
    for a in range(A):
        for k in range(P):
            prev = block_ids[a, 0] if k == 0 else labels[a, k - 1]
            cand = top[a, k]
            s = logits[a, k, cand] + ((sel.predecessor_codebook[prev] * sel.hidden_projection(h[a, k]))
                                      * sel.successor_codebook[cand]).sum(-1)
            assert picks[a, k] == cand[s.argmax()]
            if labels[a, k] in cand.tolist():
                j = cand.tolist().index(int(labels[a, k]))
                num = num + weights[a, k] * (torch.logsumexp(s, 0) - s[j])
                den += float(weights[a, k])
    assert 0 < den < float(weights.sum())
    torch.testing.assert_close(loss, num / den)
    loss.backward()
    assert sel.predecessor_codebook.grad.abs().sum() > 0 and sel.successor_codebook.grad.abs().sum() > 0


def dense_dflash2_loss(drafter, embed_w, head_w, feats, row, anchors, valid, gamma, target_hidden, kd_weight):
    """The DFlash 2 objective from its definition on materialised logits [A, B-1, V], in two passes over the head:
    (1 - w) * CE + w * CE against the target's softmax, position-weighted; plus, from a second, gradient-free
    pass, the K-way CE of unary + <P[prev] * W h, S[c]> over the top-K candidates where the label is one of them.
    -> (loss, the selector's teacher-forced picks [A, B-1])."""
    h, lay = draft_hidden(drafter, embed_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B)
    logp = torch.log_softmax(h @ head_w.t(), dim=-1)
    loss_v = -logp.gather(-1, lay.labels[..., None])[..., 0]
    if kd_weight > 0:
        prev_pos = anchors[:, None] + torch.arange(B - 1)[None, :]                  # the state predicting a+k
        p_t = torch.softmax(target_hidden[prev_pos] @ head_w.t(), dim=-1)
        loss_v = (1 - kd_weight) * loss_v - kd_weight * (p_t * logp).sum(-1)
    w = torch.exp(-torch.arange(B - 1) / gamma)[None, :] * lay.valid.float()
    with torch.no_grad():                                                           # the second pass
        unary, cand = (h @ head_w.t()).topk(drafter.candidate_selector.top_k, dim=-1)
    sel = drafter.candidate_selector
    prev = torch.cat([lay.block_ids[:, :1], lay.labels[:, :-1]], dim=1)
    ctx = sel.predecessor_codebook[prev] * sel.hidden_projection(h)                 # [A, B-1, r]
    scores = unary + (ctx[..., None, :] * sel.successor_codebook[cand]).sum(-1)     # [A, B-1, K]
    hit = cand == lay.labels[..., None]
    sel_ce = torch.logsumexp(scores, dim=-1) - (scores * hit).sum(-1)
    w_sel = w * hit.any(-1)
    assert 0 < w_sel.sum() < w.sum()                                                # both kinds of position occur
    picks = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return (loss_v * w).sum() / w.sum() + (sel_ce * w_sel).sum() / w_sel.sum(), picks, lay


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_dflash2_loss_takes_its_candidates_in_the_loss_pass_and_equals_two_dense_passes(kd_weight):
    """The step's one chunked LM-head pass (candidates taken inside the fused cross-entropy's chunks) gives the loss,
    every parameter's gradient and the acceptance metrics of the two-pass computation on dense logits, fp32."""
    torch.manual_seed(0)
    Hs, Vs, T, A = 32, 50, 48, 16
    cfg = Drafter2Config(hidden_size=Hs, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=Vs, target_layer_ids=[1, 2],
                         num_target_layers=4, mask_token_id=Vs - 1, block_size=B, conv_kernel_size=2,
                         conv_group_size=8, selector_top_k=6, selector_rank=8)
    drafter = DFlash2Drafter(cfg)
    drafter.candidate_selector.reset_parameters(std=1.0)  # a pairwise term as large as the logits
    doc = torch.arange(T) // 16
    loss_mask = torch.arange(T) % 16 >= 2
    anchors, valid = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(0))
    row = dict(input_ids=torch.randint(0, Vs - 1, (T,)), position_ids=torch.arange(T) % 16, doc_ids=doc,
               loss_mask=loss_mask)
    feats, embed_w, head_w, target_hidden = (torch.randn(T, 2 * Hs), torch.randn(Vs, Hs), torch.randn(Vs, Hs),
                                             torch.randn(T, Hs))

    out = dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B,
                      gamma=2.0, loss_chunk=7, target_hidden=target_hidden, kd_weight=kd_weight)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    ref, picks, lay = dense_dflash2_loss(drafter, embed_w, head_w, feats, row, anchors, valid, 2.0, target_hidden,
                                         kd_weight)
    ref.backward()
    torch.testing.assert_close(out["loss"], ref, rtol=1e-6, atol=1e-6)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    right = ((picks == lay.labels) & lay.valid).float().sum(0)
    torch.testing.assert_close(out["acc"], right / lay.valid.float().sum(0).clamp_min(1.0))


def test_dflash2_training_step_traces_as_one_graph_and_learns():
    """The DFlash 2 loss (drafter + selector term) traces as one graph with the same gradients as eager, and a few
    optimizer steps on a fixed row lower it (every new parameter receives gradient)."""
    from test_objective_fast import _tiny_setup

    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()
    torch.manual_seed(0)
    cfg = Drafter2Config(**drafter.config.to_dict(), conv_kernel_size=2, conv_group_size=8, selector_top_k=6,
                         selector_rank=8)
    d2 = DFlash2Drafter(cfg)

    def loss():
        return dflash_loss(d2, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid,
                           block_size=cfg.block_size, gamma=2.0, loss_chunk=7)["loss"]

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False)
    compiled().backward()
    g = {n: p.grad.clone() for n, p in d2.named_parameters()}
    d2.zero_grad(set_to_none=True)
    first = loss()
    first.backward()
    for n, p in d2.named_parameters():
        torch.testing.assert_close(g[n], p.grad, msg=n)
        assert p.grad.abs().sum() > 0, n
    opt = torch.optim.AdamW(d2.parameters(), lr=3e-3)
    for _ in range(20):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        assert float(loss()) < 0.9 * float(first)


# ------------------------------------------------------------------------------------------ FLOPs

def _cpu_sdpa_flop_formulas() -> dict:
    """FlopCounterMode formulas for the CPU's fused SDPA kernels (torch registers only the CUDA ones); dense: every
    (query, key) pair, as the boolean mask is applied inside the kernel."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *_, out_shape=None, **__: sdpa_backward_flop_count(g, q, k, v)}


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_drafter_step_flops_match_a_direct_count(architecture):
    """training/flops.py against torch's FlopCounterMode over one training step (forward and backward of the loss),
    tiny sizes chosen so that no two terms coincide, dense SDPA (every pair computed: the formula is given
    P = N * (T + N)). The counter sees matmuls and SDPA, and counts recompute; so exactly
        counted = formula - the elementwise terms (DFlash 2's conv taps and selector scores, 3x each)
                  + SDPA backward's recompute of the scores (0.5x the attention forward).
    DFlash 2's selector candidates come out of the loss's own logits: a separate LM-head pass would be counted."""
    torch.manual_seed(0)
    Bs, T, A, Hs, Vs = 4, 48, 8, 32, 50
    cfg = DrafterConfig(hidden_size=Hs, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=Vs, target_layer_ids=[1, 2],
                        num_target_layers=4, mask_token_id=Vs - 1, block_size=Bs)
    if architecture == "dflash2":
        cfg = Drafter2Config(**cfg.to_dict(), conv_kernel_size=3, conv_group_size=8, selector_top_k=6,
                             selector_rank=12)
    drafter = (DFlash2Drafter if architecture == "dflash2" else DFlashDrafter)(cfg)
    doc = torch.arange(T) // 16                                                     # 3 documents of 16 tokens
    loss_mask = torch.arange(T) % 16 >= 2
    anchors, valid = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(0))
    row = dict(input_ids=torch.randint(0, Vs - 1, (T,)), position_ids=torch.arange(T) % 16, doc_ids=doc,
               loss_mask=loss_mask, anchors=anchors, anchor_valid=valid)
    feats, embed_w, head_w = torch.randn(T, 2 * Hs), torch.randn(Vs, Hs), torch.randn(Vs, Hs)

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flop_formulas())
    with counter:
        dflash_loss(drafter, embed_w, head_w, feats, **row, block_size=Bs, gamma=2.0)["loss"].backward()
    f = drafter_step_flops(cfg, T, A, pairs=A * Bs * (T + A * Bs))
    expected = f["train"] - 3 * f.get("conv_taps", 0) - 3 * f.get("selector_scores", 0) + 0.5 * f["attention"]
    assert counter.get_total_flops() == expected, (counter.get_flop_counts()["Global"], f)
    assert ({"conv_kernels", "conv_taps", "selector_projection", "selector_scores"} <= set(f)) == \
        (architecture == "dflash2")


# ------------------------------------------------------------------------------------------ the evaluator

def test_evaluator_runs_dflash2_losslessly_and_as_the_reference_does(biased_llama, monkeypatch):
    """The project's evaluator (inference/benchmark.evaluate) with a DFlash 2 drafter: greedy output identical to
    plain decoding, and step for step the acceptance lengths of the reference's dflash_generate with the same drafter
    (so our selector loop drafts what the reference drafts)."""
    from transformers import AutoModelForCausalLM

    from dflash_train.inference.benchmark import evaluate
    from dflash_train.models.target import load_target

    t = load_target(biased_llama, LAYERS, truncate=False)
    drafter = coin_drafter(make_drafter2(biased_llama, seed=6))
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42], [7]]
    report = evaluate(t, drafter, prompts, 40, graphs=False, warmup=False)
    assert all(p.verdict == "identical" for p in report.prompts)
    assert max(report.steps) > 1 and min(report.steps) < B
    assert all(p.tau_estimate is not None for p in report.prompts)
    ref = ref_dflash.DFlash2DraftModel(_ref_config(drafter)).eval()
    ref.load_state_dict({k + ".weight" if k.endswith("_codebook") else k: v for k, v in drafter.state_dict().items()})
    hf = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    monkeypatch.setattr(ref_dflash, "_cuda_time", time.perf_counter)
    for p, rep in zip(prompts, report.prompts):
        spec = ref_dflash.dflash_generate(ref, hf, torch.tensor([p]), 40, None, block_size=B, return_stats=True)
        assert spec.output_ids[0, len(p):].tolist() == rep.speculative
        assert spec.acceptance_lengths[:-1] == rep.accept_lengths[:len(spec.acceptance_lengths) - 1]


def _ref_config(drafter):
    return Qwen3Config(**drafter_config_json(drafter.config))


def test_sampled_dflash2_speculative_matches_target_distribution(tmp_path):
    """Speculative sampling with the selector's sparse proposals (top-4 of 8 tokens, re-ranked by a strong pairwise
    term): the 2nd and 3rd generated tokens follow the target's exact marginals."""
    from dflash_train.models.target import load_target

    Vs, T = 8, 1.0
    path = make_tiny_target(tmp_path / "t8", "llama", vocab_size=Vs, initializer_range=0.06)
    t = load_target(path, LAYERS, truncate=False)
    drafter = make_drafter2(path, f"model.mask_token_id={Vs - 1}", "model.selector_top_k=4", jitter=0.0)
    prompt = [3, 1, 4]
    g = torch.Generator().manual_seed(0)
    N = 1000
    counts, taus = torch.zeros(2, Vs), torch.zeros(B + 1)
    t_run, d_run, _ = dflash2_decode(t, drafter, prompt, 3, max_len=32)
    from dflash_train.inference.speculative import speculative_generate
    for _ in range(N):
        out = speculative_generate(t_run, d_run, prompt, 3, temperature=T, generator=g)
        counts[0, out.tokens[1]] += 1
        counts[1, out.tokens[2]] += 1
        taus[out.accept_lengths[0]] += 1
    assert taus[1] > 50 and taus[2:].sum() > 50      # rejections and acceptances both ran
    with torch.no_grad():
        p1 = torch.softmax(t.hf(input_ids=torch.tensor([prompt])).logits[0, -1] / T, -1)
        p2 = torch.softmax(t.hf(input_ids=torch.tensor([prompt + [a] for a in range(Vs)])).logits[:, -1] / T, -1)
        joint12 = p1[:, None] * p2
        seq3 = torch.tensor([prompt + [a, b] for a in range(Vs) for b in range(Vs)])
        p3 = torch.softmax(t.hf(input_ids=seq3).logits[:, -1] / T, -1).view(Vs, Vs, Vs)
        m2, m3 = joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))
    tv = [float(0.5 * (counts[0] / N - m2).abs().sum()), float(0.5 * (counts[1] / N - m3).abs().sum())]
    assert max(tv) < 0.06, tv


def test_tiny_dflash2_run_learns_the_stream_and_exports_for_the_reference(tiny_llama, tmp_path):
    """The same trainer with model.architecture=dflash2: the selector-driven acceptance estimate reaches the block
    on the predictable synthetic stream, validation's decoding tau follows, and the servable drafter loads into the
    reference with no missing or unexpected keys."""
    from dflash_train.training.trainer import train_single_device

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "train.max_steps=80", "train.log_every=10", "model.architecture=dflash2",
                                   "model.selector_top_k=8", "model.selector_rank=16"])
    res = train_single_device(cfg)
    assert res.history[0]["tau_est"] < 4 and res.history[-1]["tau_est"] > 7.0   # B = 8
    assert res.val_history[-1]["tau_decoding"] > 6.0
    _, info = ref_dflash.DFlash2DraftModel.from_pretrained(str(res.drafter_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert isinstance(load_drafter(res.drafter_dir), DFlash2Drafter)
