"""train.optimizer=muon: Muon for the drafter's matrices, AdamW for its vectors (training/muon.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_train.config import ConfigError, TrainConfig, load_config
from dflash_train.training.muon import RMS_MATCH, MuonAdamW, is_matrix, orthogonalise
from dflash_train.training.optim import Updater, build_optimizer, build_scheduler


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Two matrices of one shape, one of another (tall), a vector and a 1 x n row (AdamW's, not Muon's)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (6, 4), (3, 8), (5,), (1, 7)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(params, step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale


def test_orthogonalise_keeps_singular_vectors_and_pulls_singular_values_towards_one():
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 16, 8), (4, 8, 16)]:                    # tall and wide, batched
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x[0] *= 1000.0                                         # scale does not matter
        o = orthogonalise(x)
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        core = u.mT @ o @ vh.mT                                # diagonal when the singular vectors are kept
        diag = torch.diagonal(core, dim1=-2, dim2=-1)
        off = core - torch.diag_embed(diag)
        assert off.abs().max() < 1e-6
        assert diag.min() > 0.5 and diag.max() < 1.3, diag     # the quintic's band around 1, not exactly 1
        for i in range(shape[0]):                              # batched = one matrix at a time
            torch.testing.assert_close(o[i], orthogonalise(x[i]))


def test_matrices_take_muon_and_everything_else_adamw():
    opt = MuonAdamW(_params(), lr=1e-2)
    kinds = {g["muon"]: [tuple(p.shape) for p in g["params"]] for g in opt.param_groups}
    assert kinds == {True: [(6, 4), (6, 4), (3, 8)], False: [(5,), (1, 7)]}
    assert not is_matrix(torch.zeros(1, 7)) and not is_matrix(torch.zeros(2, 3, 4)) and is_matrix(torch.zeros(2, 3))


def test_the_vectors_follow_torch_adamw_exactly():
    ours, ref = _params(), _params()
    opt = MuonAdamW(ours, lr=3e-2, betas=(0.8, 0.9), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref[3:], lr=3e-2, betas=(0.8, 0.9), weight_decay=0.1, foreach=False)
    for step in range(6):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours[3:], ref[3:]):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_the_matrices_follow_the_muon_update_written_out():
    """Momentum, Nesterov, the orthogonalised update at AdamW's RMS, decoupled weight decay: one matrix at a time
    against the batched, multi-tensor step."""
    lr, wd, m = 2e-2, 0.1, 0.9
    ours, ref = _params(), [p.detach().clone() for p in _params()]
    opt = MuonAdamW(ours, lr=lr, weight_decay=wd, momentum=m)
    bufs = [torch.zeros_like(p) for p in ref[:3]]
    for step in range(4):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        for w, buf in zip(ref[:3], bufs):
            buf.mul_(m).add_(w.grad)
            update = orthogonalise(w.grad + m * buf)
            w.mul_(1 - lr * wd).sub_(lr * RMS_MATCH * max(w.shape) ** 0.5 * update)
    for p, r in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_a_muon_update_has_adamw_s_rms():
    w = torch.nn.Parameter(torch.zeros(64, 256))
    opt = MuonAdamW([w], lr=1.0)
    w.grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    opt.step()
    rms = w.detach().pow(2).mean().sqrt().item()
    assert 0.5 * RMS_MATCH < rms < 1.3 * RMS_MATCH, rms


def test_found_inf_skips_the_step_exactly():
    """found_inf = 1 leaves weights and state as they were; the run then goes on as if that step had not been."""
    skipped, clean = _params(), _params()
    opt, ref = MuonAdamW(skipped, lr=1e-2, weight_decay=0.1), MuonAdamW(clean, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        for ps, o in ((skipped, opt), (clean, ref)):
            _grads(ps, step)
            o.found_inf = torch.zeros(())
            o.step()
    before = [p.detach().clone() for p in skipped], copy.deepcopy(opt.state_dict()["state"])
    _grads(skipped, 99, scale=float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    for p, b in zip(skipped, before[0]):
        assert torch.equal(p.detach(), b)
    after = opt.state_dict()["state"]
    for i, state in before[1].items():
        for key, value in state.items():
            assert torch.equal(after[i][key], value), (i, key)
    for step in range(2, 4):
        for ps, o in ((skipped, opt), (clean, ref)):
            _grads(ps, step)
            o.found_inf = torch.zeros(())
            o.step()
    for p, r in zip(skipped, clean):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_the_updater_skips_non_finite_steps_on_the_device_with_muon():
    cfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, optimizer="muon")
    params = _params()
    opt = build_optimizer(params, cfg, torch.device("cpu"))
    update = Updater(params, opt, build_scheduler(opt, cfg, 6), 1.0, "skip", announce=False)
    assert isinstance(opt, MuonAdamW) and update.on_device
    for step in range(1, 7):
        _grads(params, step, scale=float("inf") if step == 3 else 1.0)
        update(step)
    assert update.skipped(6) == 1
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.state[params[3]]["step"].item() == 5


def test_state_dict_round_trip_resumes_bit_exactly():
    a = _params()
    opt_a = MuonAdamW(a, lr=1e-2)
    for step in range(3):
        _grads(a, step)
        opt_a.step()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = MuonAdamW(b, lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for step in range(3, 5):
        for ps, o in ((a, opt_a), (b, opt_b)):
            _grads(ps, step)
            o.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="train.optimizer must be one of adamw, muon"):
        load_config("tiny_cpu", ["train.optimizer=sgd"])
    with pytest.raises(ConfigError, match=r"train.muon_momentum must be in \[0, 1\)"):
        load_config("tiny_cpu", ["train.optimizer=muon", "train.muon_momentum=1.0"])
