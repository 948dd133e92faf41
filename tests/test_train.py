"""Single-device reference trainer, servable checkpoints, config and CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_train.cli import main as cli_main
from dflash_train.config import ConfigError, load_config
from dflash_train.devices import resolve_config
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.models.target import target_config_info
from dflash_train.training.trainer import train_single_device

SHARED_CHECKER = Path(__file__).resolve().parents[2] / "shared" / "tools" / "check_dflash_checkpoint.py"


def tiny_cfg(target, out, **over):
    ov = [f"model.target={target}", f"run.out_dir={out}"] + [f"{k}={v}" for k, v in over.items()]
    return load_config("tiny_cpu", ov)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tiny_run_learns_the_predictable_stream(optimizer, tiny_llama, tmp_path):
    # The synthetic stream is fully determined by its previous token (period 8): a random drafter scores ~1/128
    # (the vocabulary), the best unigram guess 1/8; a drafter that learned the rule scores 1 at every position.
    cfg = tiny_cfg(tiny_llama, tmp_path / "run", **{"train.max_steps": 80, "train.log_every": 1,
                                                   "train.optimizer": optimizer})
    res = train_single_device(cfg)
    first, last = res.history[0], res.history[-1]
    assert first["acc"][0] < 0.3, first["acc"]
    assert last["acc"][0] > 0.95, last["acc"]
    assert last["loss"] < 0.25 * first["loss"]
    assert last["tau_est"] > 7.0                      # B = 8, so tau <= 8
    assert first["grad_norm"] > last["grad_norm"] > 0  # each window's gradient norm before clipping is logged


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_checkpoint_format_and_bit_exact_reload(kind, tiny_llama, tiny_qwen3, tmp_path):
    target = {"llama": tiny_llama, "qwen3": tiny_qwen3}[kind]
    cfg = load_config(None, [f"model.target={target}", "model.num_draft_layers=2", "model.mask_token_id=127"])
    drafter = build_drafter(cfg.model, target_config_info(target))
    out = save_drafter(drafter, tmp_path / "d")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["block_size"] == 16 and conf["num_target_layers"] == 4
    assert conf["dflash_config"] == {"target_layer_ids": [1], "mask_token_id": 127, "block_size": 16}
    assert conf["layer_types"] == ["full_attention", "full_attention"]
    assert conf["num_hidden_layers"] == 2 and conf["hidden_size"] == 64
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected
    back = load_drafter(out)  # the bf16 export: the fp32 weights rounded once, bit for bit
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a.to(torch.bfloat16), b), k
    if SHARED_CHECKER.is_file():  # the project's contract checker, when the shared tools are beside the checkout
        r = subprocess.run([sys.executable, str(SHARED_CHECKER), str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_default_drafter_is_sized_from_target(tiny_qwen3):
    cfg = load_config(None, [f"model.target={tiny_qwen3}", "model.mask_token_id=5"])
    d = build_drafter(cfg.model, target_config_info(tiny_qwen3))
    c = d.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (64, 4, 2, 16, 128)
    assert c.num_hidden_layers == 1 and c.block_size == 16
    assert c.target_layer_ids == [1]  # L = 4: layers 1..L-3 hold one distinct tap, not 5


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.block_size must be at least 2"):
        load_config(None, ["model.block_size=1"])
    with pytest.raises(ConfigError, match="Unknown config key train.lrr"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="train.lr must be a number"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match="Unknown config section"):
        load_config(None, ["trian.lr=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("args, needle", [
    (["train", "--single", "--config", "tiny_cpu", "model.target=/nonexistent/model"], "does not exist"),
    (["train", "--single", "--config", "tiny_cpu", "model.block_size=1"], "model.block_size must be at least 2"),
    (["train", "--single", "--config", "no_such_recipe"], "neither a file nor a bundled recipe"),
    (["train", "--single", "--config", "tiny_cpu", "train.compile=fast"], "train.compile must be one of"),
])
def test_cli_bad_input_is_one_error_line(args, needle, capsys, tmp_path):
    code = cli_main(args + [f"run.out_dir={tmp_path}/r"] if "=" in args[-1] else args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_out_dir_holding_a_different_run_is_refused(tiny_llama, tmp_path):
    cfg = tiny_cfg(tiny_llama, tmp_path / "run", **{"train.max_steps": 2})
    train_single_device(cfg)
    other = tiny_cfg(tiny_llama, tmp_path / "run", **{"train.max_steps": 2, "train.lr": 1e-4})
    with pytest.raises(ConfigError, match="already holds a different run"):
        train_single_device(other)


def test_run_plots_switch_draws_training_png_or_nothing(tiny_llama, tmp_path):
    train_single_device(tiny_cfg(tiny_llama, tmp_path / "off", **{"train.max_steps": 2}))  # tiny_cpu: plots off
    assert not (tmp_path / "off" / "training.png").exists()
    train_single_device(tiny_cfg(tiny_llama, tmp_path / "on", **{"train.max_steps": 2, "run.plots": "true"}))
    assert (tmp_path / "on" / "training.png").stat().st_size > 10_000


def test_run_written_before_a_config_field_existed_still_resumes(tmp_path):
    """A run saved by an older version (its run_config.yaml lacks a field added since) is the same run when the
    new field sits at its default, and a different one when it does not (found resuming a GPU run)."""
    import yaml

    from dflash_train.config import load_config
    from dflash_train.training.run import RUN_CONFIG_NAME, prepare_out_dir

    out = tmp_path / "run"
    cfg = load_config(None, [f"run.out_dir={out}", "data.source=synthetic"])
    prepare_out_dir(cfg)
    saved = yaml.safe_load((out / RUN_CONFIG_NAME).read_text())
    del saved["data"]["synthetic_max_len"]                       # as written before the field existed
    (out / RUN_CONFIG_NAME).write_text(yaml.safe_dump(saved))
    prepare_out_dir(cfg)                                          # same run: no error
    (out / RUN_CONFIG_NAME).write_text(yaml.safe_dump(saved))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')           # it trained: a different config is refused
    changed = load_config(None, [f"run.out_dir={out}", "data.source=synthetic", "data.synthetic_max_len=200"])
    with pytest.raises(ConfigError, match="already holds a different run"):
        prepare_out_dir(changed)


def test_only_the_owner_rank_checks_and_writes_the_run_config(tmp_path):
    """Under torchrun a node may name its own paths: a non-owner rank neither refuses them nor rewrites rank 0's
    run_config.yaml."""
    from dflash_train.config import load_config
    from dflash_train.training.run import RUN_CONFIG_NAME, prepare_out_dir

    out = tmp_path / "run"
    prepare_out_dir(load_config(None, [f"run.out_dir={out}", "data.source=synthetic", "model.target=/node0/m"]))
    written = (out / RUN_CONFIG_NAME).read_text()
    node1 = load_config(None, [f"run.out_dir={out}", "data.source=synthetic", "model.target=/node1/m"])
    assert prepare_out_dir(node1, owner=False) == out and (out / RUN_CONFIG_NAME).read_text() == written
    (out / "metrics.jsonl").write_text('{"step": 1}\n')           # rank 0's run trained: node 1's paths differ
    with pytest.raises(ConfigError, match="already holds a different run"):
        prepare_out_dir(node1)


def test_device_side_skip_matches_the_host_decision(caplog):
    """With fused AdamW (CUDA; fused also runs on CPU, which this test uses) the non-finite skip is decided on the
    device: same weights, moments and step counts as the host decision, the count read only when asked for."""
    from dflash_train.config import TrainConfig
    from dflash_train.training.optim import NonFiniteError, Updater, build_scheduler

    cfg = TrainConfig(lr=1e-2, warmup_ratio=0.0)
    bad_steps = {2, 5}

    def run(fused: bool, nonfinite: str):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        opt = torch.optim.AdamW(params, lr=cfg.lr, fused=fused)
        update = Updater(params, opt, build_scheduler(opt, cfg, 8), 1.0, nonfinite)
        for step in range(1, 9):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * (float("nan") if step in bad_steps else 1.0)
            update(step)
        return update, params, opt

    device, params, opt = run(fused=True, nonfinite="skip")
    assert device.on_device and device._count.item() == 2
    host, ref_params, ref_opt = run(fused=False, nonfinite="skip")
    assert not host.on_device
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r)
        assert opt.state[p]["step"].item() == ref_opt.state[r]["step"].item() == 6
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
    with caplog.at_level("WARNING", logger="dflash_train"):
        assert device.skipped(8) == 2 and host.skipped(8) == 2
    assert "by step 8: 2 more step(s) with a non-finite loss or gradients, update skipped (2 so far)" in caplog.text
    with pytest.raises(NonFiniteError, match="Step 2 has a non-finite loss"):
        run(fused=True, nonfinite="stop")          # stop decides on the host, at the step itself


def test_grad_norms_report_the_window_before_clipping():
    """The log window's gradient norms are those clip_grad_norm_ saw (before clipping): the mean over the finite
    steps, the max, and the share of steps the clip cut; a non-finite step is left out; a read starts a new window."""
    from dflash_train.config import TrainConfig
    from dflash_train.training.metrics import _grad_note
    from dflash_train.training.optim import Updater, build_scheduler

    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.0)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
    update = Updater(params, opt, build_scheduler(opt, cfg, 8), 1.0, "skip", announce=False)
    grads = {1: ([0.3, 0.4], [0.0]), 2: ([2.0, 0.0], [0.0]), 3: ([float("inf"), 0.0], [0.0]), 4: ([0.0, 0.0], [1.0])}
    for step, (a, b) in grads.items():
        params[0].grad, params[1].grad = torch.tensor(a), torch.tensor(b)
        update(step)
    norms = update.grad_norms()            # finite steps: 0.5, 2.0, 1.0; only 2.0 is over the clip of 1.0
    assert norms == pytest.approx({"grad_norm": 3.5 / 3, "grad_norm_max": 2.0, "clipped": 1 / 3})
    assert _grad_note(dict(norms)) == " | gnorm 1.17 (max 2.00, 33% clipped)"
    assert update.grad_norms() == {}       # nothing since the read
    unclipped = Updater(params, opt, build_scheduler(opt, cfg, 8), 0.0, "skip")
    params[0].grad, params[1].grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0])
    unclipped(1)
    assert unclipped.grad_norms() == pytest.approx({"grad_norm": 5.0, "grad_norm_max": 5.0})


def test_log_window_estimate_covers_every_block_of_the_window():
    """A log line's acc / tau estimate is that of all blocks of its window together (summed counts), not the
    last batch's; its loss is the window's mean."""
    from dflash_train.training.metrics import StepWindow
    from dflash_train.training.objective import acceptance_metrics

    g = torch.Generator().manual_seed(0)
    steps = [(torch.rand(32, 7, generator=g) < p, torch.rand(32, 7, generator=g) < 0.9) for p in (0.9, 0.3, 0.6)]
    window = StepWindow()
    for i, (correct, valid) in enumerate(steps):
        window.add(dict(acceptance_metrics(correct, valid), loss=torch.tensor(float(i)), num_labels=valid.sum()))
    got = window.take()
    whole = acceptance_metrics(torch.cat([c for c, _ in steps]), torch.cat([v for _, v in steps]))
    for k in ("acc", "cond_acc", "tau_est", "counts"):
        torch.testing.assert_close(got[k], whole[k])
    assert float(got["loss"]) == 1.0 and int(got["num_labels"]) == sum(int(v.sum()) for _, v in steps)
    with pytest.raises(RuntimeError, match="no step"):
        window.take()                                    # taken: the next window starts empty


def test_a_window_holding_a_validation_reads_the_training_s_own_speed(monkeypatch):
    """Time the validator reports (MetricsLogger.exclude) is left out of the window's step time and tokens/s and
    stated as excluded_s; the next window starts clean. A fake clock: no wall time is measured."""
    from dflash_train.training import metrics as metrics_mod
    from dflash_train.training.objective import acceptance_metrics

    clock = iter([0.0, 10.0, 13.0])
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    logger = metrics_mod.MetricsLogger(None, total_steps=200, tokens_per_step=1000, log_every=100)
    window = dict(acceptance_metrics(torch.ones(4, 3, dtype=torch.bool), torch.ones(4, 3, dtype=torch.bool)),
                  loss=torch.tensor(1.0))
    logger.exclude(2.0)                              # a validation pass inside the first window
    first = logger.log(100, window, lr=1e-3)         # 10 s of wall time, 8 of them training
    second = logger.log(200, window, lr=1e-3)        # 3 s, all training
    assert (first["step_time_s"], first["tokens_per_s"], first["excluded_s"]) == (0.08, 12500.0, 2.0)
    assert (second["step_time_s"], second["excluded_s"]) == (0.03, 0.0)


def test_importing_changes_no_compile_setting_and_a_compiled_step_applies_the_policy(tiny_llama):
    """Importing the package's modules leaves torch's compile settings alone; a step that compiles first applies the
    policy (trees off for worker threads, donated buffers off for correct grads under per-function CUDA graphs)."""
    probe = ("import torch._inductor.config as c, torch._functorch.config as f\n"
             "before = (c.triton.cudagraph_trees, f.donated_buffer)\n"
             "import dflash_train.cli, dflash_train.train, dflash_train.demo, dflash_train.training.step\n"
             "import dflash_train.training.trainer, dflash_train.pipeline.coordinator, dflash_train.training.objective\n"
             "print(before == (c.triton.cudagraph_trees, f.donated_buffer), before)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)  # hang guard
    assert out.stdout.startswith("True (True, True)"), out.stdout + out.stderr

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from dflash_train.training.step import DrafterStep

    cfg = load_config(None, [f"model.target={tiny_llama}", "model.mask_token_id=127", "train.compile=default"])
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama))
    inductor_config.triton.cudagraph_trees, functorch_config.donated_buffer = True, True  # torch's defaults
    DrafterStep(drafter, torch.zeros(128, drafter.config.hidden_size), torch.zeros(128, drafter.config.hidden_size),
                resolve_config(cfg).train, torch.device("cpu"))
    assert inductor_config.triton.cudagraph_trees is False and functorch_config.donated_buffer is False


@pytest.mark.parametrize("entry", ["pipeline", "single"])
def test_every_training_entry_applies_the_policy_before_it_compiles(tiny_llama, tmp_path, monkeypatch, entry):
    """With torch's defaults in place (trees and donated buffers on), a run through either training entry (the CLI's
    train and the demo go through them) has the policy in force at every torch.compile call it makes."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from dflash_train.pipeline.coordinator import train_pipeline

    seen = []

    def record(fn, *args, **kwargs):  # what each compile call would have compiled under; the step then runs eagerly
        seen.append((inductor_config.triton.cudagraph_trees, functorch_config.donated_buffer))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    cfg = tiny_cfg(tiny_llama, tmp_path / entry, **{"train.compile": "default", "train.max_steps": 2})
    # torch's defaults for the run, restored afterwards (the policy the run applies does not leak into other tests)
    with inductor_config.patch({"triton.cudagraph_trees": True}), functorch_config.patch(donated_buffer=True):
        (train_pipeline if entry == "pipeline" else train_single_device)(cfg)
    assert seen and set(seen) == {(False, False)}, seen


def test_fresh_drafter_output_gain_matches_the_head(tiny_llama, tmp_path):
    """A fresh run scales the final-norm gain to 1 / mean row norm of the frozen LM head (near-uniform start)."""
    from dflash_train.models.build import init_output_norm

    cfg = load_config(None, [f"model.target={tiny_llama}", "model.mask_token_id=127"])
    d = build_drafter(cfg.model, target_config_info(tiny_llama))
    head = torch.full((10, 4), 0.5)                       # every row has norm 1.0
    assert init_output_norm(d, head) == pytest.approx(1.0)
    assert torch.all(d.norm.weight == 1.0)
    init_output_norm(d, 2 * head)
    assert torch.allclose(d.norm.weight, torch.full_like(d.norm.weight, 0.5))


def test_every_bundled_recipe_loads():
    """A recipe with a misspelt key or an invalid value would fail only when a user runs it: load each one here."""
    from pathlib import Path

    import dflash_train
    from dflash_train.config import load_config

    names = sorted(p.stem for p in (Path(dflash_train.__file__).parent / "recipes").glob("*.yaml"))
    assert {"tiny_cpu", "smollm2_demo", "smollm2_gpu", "smollm2_gpu2"} <= set(names)
    for name in names:
        cfg = load_config(name, [])
        assert cfg.train.token_budget > 0, name
