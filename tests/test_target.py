"""Target adapter: taps, truncation, packing exactness, bad input."""

from __future__ import annotations

import pytest
import torch

from dflash_train.data.packing import Sample, pack_samples
from dflash_train.models.target import TargetError, default_layer_ids, load_target


def test_default_layer_ids_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]


def test_features_match_hidden_states(tiny_target):
    t = load_target(tiny_target, [0, 2], truncate=False)
    ids = torch.randint(0, 128, (20,))
    feats = t.features(ids, torch.arange(20), torch.zeros(20, dtype=torch.long))
    assert feats.shape == (20, 2 * 64)
    with torch.no_grad():
        hs = t.hf(input_ids=ids[None], output_hidden_states=True).hidden_states
    # hidden state i+1 is the output of layer i
    torch.testing.assert_close(feats, torch.cat([hs[1][0], hs[3][0]], -1), atol=1e-5, rtol=1e-5)


def test_truncation_drops_later_layers_without_changing_features(tiny_target):
    full = load_target(tiny_target, [1, 2], truncate=False)
    cut = load_target(tiny_target, [1, 2], truncate=True)
    assert len(cut.hf.model.layers) == 3
    ids = torch.randint(0, 128, (16,))
    args = (ids, torch.arange(16), torch.zeros(16, dtype=torch.long))
    torch.testing.assert_close(cut.features(*args), full.features(*args))


def random_docs(lengths, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 128, (n,), generator=g).tolist(), [True] * n) for n in lengths]


def assert_features_alone(target, docs: list[Sample], packed: torch.Tensor) -> None:
    """packed [T, k*H] starts with each document's features as `target` computes them for the document alone."""
    start = 0
    for d in docs:
        n = len(d.input_ids)
        alone = target.features(torch.tensor(d.input_ids), torch.arange(n), torch.zeros(n, dtype=torch.long))
        torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=1e-5)
        start += n


def test_packed_documents_get_the_same_features_as_alone(tiny_target):
    t = load_target(tiny_target, [1, 3])
    docs = random_docs((7, 11, 5), seed=0)
    (row,) = pack_samples(docs, 32)
    assert_features_alone(t, docs, t.features(row.input_ids, row.position_ids, row.doc_ids))


def test_flex_target_attention_is_exact(tiny_target):
    """model.target_attention=flex (a BlockMask, no dense mask) gives the sdpa path's features on a packed row with
    padding, and each packed document gets its features alone (CPU fp32, no grad: flex runs its compiled CPU kernel)."""
    sdpa = load_target(tiny_target, [1, 3], attention="sdpa")
    flex = load_target(tiny_target, [1, 3], attention="flex")
    assert (sdpa.attention, flex.attention) == ("sdpa", "flex")
    docs = random_docs((70, 41, 30), seed=1)
    (row,) = pack_samples(docs, 160)  # 19 padding tokens; T not a multiple of flex's 128-token tiles
    args = (row.input_ids, row.position_ids, row.doc_ids)
    packed = flex.features(*args)
    torch.testing.assert_close(packed, sdpa.features(*args), atol=1e-5, rtol=1e-5)
    assert_features_alone(sdpa, docs, packed)  # alone through sdpa: one flex compile (one shape) per test


@pytest.mark.parametrize("lens,T,tile", [((70, 41, 30), 160, 32), ((128, 128, 256), 512, 128),
                                         ((5, 300, 1, 90), 400, 64), ((40,), 40, 128)])
def test_target_block_mask_tiles_cover_exactly_the_document_causal_pairs(lens, T, tile):
    """The tile-level BlockMask (built without host syncs, so model.target_graphs can capture it) gives exactly
    doc_causal_mask's pairs, full tiles are really full, and tiles without a visible pair are mostly skipped."""
    from dflash_train.models.target import doc_causal_block_mask, doc_causal_mask

    (row,) = pack_samples(random_docs(lens, seed=0), T)   # padding (-1) after the documents when they fall short
    bm = doc_causal_block_mask(row.doc_ids, tile=tile)
    dense = doc_causal_mask(row.doc_ids)[0, 0]
    from torch.nn.attention.flex_attention import create_mask
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, T, T, device="cpu")[0, 0], dense)
    n = -(-T // tile)
    full = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in bm.full_kv_indices[0, 0, i, : int(bm.full_kv_num_blocks[0, 0, i])].tolist():
            full[i, j] = True
            assert dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].all()
    listed = bm.to_dense()[0, 0].bool()
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            visible[i, j] = dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].any()
    assert torch.equal(listed & visible, visible) and int((listed & ~visible).sum()) <= n


def test_graphed_features_reuse_static_buffers_and_hand_out_copies(tiny_target):
    """model.target_graphs' wrapper (eager here; captured on CUDA): rows copied into static buffers give the plain
    forward's features, each call's result survives the next call, and a row of another length is refused."""
    from dflash_train.models.target import FeatureForward

    t = load_target(tiny_target, [1, 3])
    rows = [pack_samples(random_docs(lens, seed=i), 32)[0] for i, lens in enumerate([(7, 11, 5), (20, 12), (32,)])]
    fn = FeatureForward(t, 32, graphs=False)
    outs = [fn(r.input_ids, r.position_ids, r.doc_ids) for r in rows]
    for r, out in zip(rows, outs):
        torch.testing.assert_close(out, t.features(r.input_ids, r.position_ids, r.doc_ids))
    with pytest.raises(ValueError, match="rows of 32"):
        fn(torch.zeros(16, dtype=torch.long), torch.arange(16), torch.zeros(16, dtype=torch.long))
    FeatureForward(load_target(tiny_target, [1, 3], attention="flex"), 32, graphs=False)  # flex is accepted too


def test_target_graphs_config_errors_are_one_sentence(tiny_llama, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.config import load_config

    assert load_config(None, ["model.target_graphs=true", "model.target_attention=flex"]).model.target_graphs
    code = main(["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", f"run.out_dir={tmp_path}/r",
                 "model.target_graphs=true", "train.max_steps=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs CUDA target devices" in err[0], err


def test_flex_target_refuses_the_inference_path(tiny_llama):
    t = load_target(tiny_llama, [1], truncate=False, attention="flex")
    with pytest.raises(RuntimeError, match="attention='sdpa'"):
        t.forward_with_cache(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                             torch.ones(1, 1, 1, 1, dtype=torch.bool), {}, 1)
    with pytest.raises(TargetError, match="sdpa, flex, auto"):
        load_target(tiny_llama, [1], attention="dense")


def test_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        load_target(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        load_target(str(tmp_path / "empty"))


def test_untappable_architecture_is_one_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(TargetError, match="Cannot tap GPT2LMHeadModel"):
        load_target(str(tmp_path / "gpt2"), [0])


def test_layer_ids_out_of_range(tiny_llama):
    with pytest.raises(TargetError, match="within 0..3"):
        load_target(tiny_llama, [1, 7])
