"""The batch schedule: epochs planned ahead on a side thread, rows built as they are consumed, batch for batch what
packing in place gives."""

from __future__ import annotations

import threading

import pytest
import torch


def test_epochs_packed_ahead_give_the_batches_of_packing_in_place():
    """The schedule packs the next epoch on a side thread (no stall at epoch boundaries): the batches are exactly
    those of packing each epoch when it starts, from any start, and a closed iterator leaves no thread behind."""
    from dflash_train.data.packing import BatchSchedule, epoch_rows, make_batch
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(50, period=8, seed=0, max_len=96)
    schedule = BatchSchedule(samples, 256, 16, seed=3, max_batches=70)

    def in_place(start):
        index, epoch = 0, 0
        while index < 70:
            for row in epoch_rows(samples, 256, epoch, 3):
                if start <= index < 70:
                    yield make_batch(row, 16, 3, index, epoch)
                index += 1
            epoch += 1

    for start in (0, 23, 69):
        got, want = list(schedule.iter_from(start)), list(in_place(start))
        assert [b.index for b in got] == [b.index for b in want] == list(range(start, 70))
        assert [b.epoch for b in got] == [b.epoch for b in want] and max(b.epoch for b in want) >= 2 or start == 69
        for a, b in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    it = iter(schedule.iter_from(0))
    next(it)
    it.close()  # the loader stopping mid-epoch: closing waits for the epoch being packed, then no thread is left
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dflash-pack")]


def test_rows_are_built_one_at_a_time_by_the_consumer_not_by_the_side_thread(monkeypatch):
    """The side thread only plans an epoch (lengths); a row's tensors are built when its first batch is made, in the
    consuming thread, once for all of its repeats (train.steps_per_row): an epoch boundary holds no burst of
    Python work that would slow the pipeline's threads (the GIL)."""
    from dflash_train.data import packing
    from dflash_train.data.packing import BatchSchedule
    from dflash_train.data.synthetic import synthetic_samples

    built = []
    real_make_row = packing.make_row

    def counting_make_row(*args, **kwargs):
        built.append(threading.current_thread().name)
        return real_make_row(*args, **kwargs)

    monkeypatch.setattr(packing, "make_row", counting_make_row)
    samples = synthetic_samples(50, period=8, seed=0, max_len=96)
    schedule = BatchSchedule(samples, 256, 16, seed=3, max_batches=70, repeats=2)
    assert schedule.rows_per_epoch > 5
    it = iter(schedule.iter_from(0))
    first = [next(it) for _ in range(6)]  # three rows, two batches each
    assert [b.index for b in first] == list(range(6))
    assert built == [threading.current_thread().name] * 3
    assert first[0].input_ids is first[1].input_ids and first[0].input_ids is not first[2].input_ids
    it.close()


def test_a_wait_for_an_epoch_being_packed_calls_back_and_can_stop(monkeypatch):
    """The loader beats while an epoch is packed (a slow pack on a busy machine is not a stalled loader) and stops
    from inside that wait; the batches do not change."""
    from dflash_train.data import packing
    from dflash_train.data.packing import BatchSchedule
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(50, period=8, seed=0, max_len=96)
    schedule = BatchSchedule(samples, 256, 16, seed=3, max_batches=70)
    want = [b.index for b in schedule.iter_from(0)]
    packed = threading.Event()
    slow_epoch = schedule._epoch

    def gated_epoch(epoch):
        packed.wait()  # held until the consumer has waited once
        return slow_epoch(epoch)

    monkeypatch.setattr(schedule, "_epoch", gated_epoch)
    calls = []

    def waiting():
        calls.append(1)
        packed.set()

    assert [b.index for b in schedule.iter_from(0, waiting=waiting)] == want
    assert calls  # called while epoch 0 was held back

    class Stop(Exception):
        pass

    packed.clear()
    monkeypatch.setattr(packing, "PACK_POLL_S", 0.01)

    def stop():
        packed.set()
        raise Stop

    with pytest.raises(Stop):
        next(iter(schedule.iter_from(0, waiting=stop)))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dflash-pack")]


def _naive_pack(samples, budget, pad_id):
    """Greedy packing written out per token: the reference for pack_samples' array slices."""
    rows, cur = [], []
    for ids, mask in samples:
        ids, mask = ids[:budget], mask[:budget]
        if not ids:
            continue
        if sum(len(c[0]) for c in cur) + len(ids) > budget:
            rows.append(cur)
            cur = []
        cur.append((ids, mask))
    if cur:
        rows.append(cur)
    out = []
    for docs in rows:
        t_ids, t_pos, t_doc, t_mask = [], [], [], []
        for d, (ids, mask) in enumerate(docs):
            t_ids += ids
            t_pos += list(range(len(ids)))
            t_doc += [d] * len(ids)
            t_mask += mask
        pad = budget - len(t_ids)
        out.append((t_ids + [pad_id] * pad, t_pos + list(range(pad)), t_doc + [-1] * pad, t_mask + [False] * pad))
    return out


def test_pack_samples_equals_packing_token_by_token():
    import random

    from dflash_train.data.packing import Sample, pack_samples

    rng = random.Random(7)
    raw = []
    for _ in range(200):
        n = rng.choice([0, 1, 5, 40, 97, 130, 300])  # empty, tiny, and longer than the budget (truncated)
        raw.append(([rng.randrange(1000) for _ in range(n)], [rng.random() < 0.6 for _ in range(n)]))
    got = pack_samples([Sample(i, m) for i, m in raw], 128, pad_id=9)
    want = _naive_pack(raw, 128, 9)
    assert len(got) == len(want)
    for row, (ids, pos, doc, mask) in zip(got, want):
        assert row.input_ids.tolist() == ids and row.position_ids.tolist() == pos
        assert row.doc_ids.tolist() == doc and row.loss_mask.tolist() == mask
        assert row.input_ids.dtype == row.position_ids.dtype == row.doc_ids.dtype == torch.long
        assert row.loss_mask.dtype == torch.bool


def test_steps_per_row_repeats_each_row_with_its_own_anchors_from_any_start():
    """train.steps_per_row = 3: every row is three consecutive batches (same tokens, anchors of their own), and a
    resume in the middle of a row gives the batches of the uninterrupted schedule from there."""
    from dflash_train.data.packing import BatchSchedule
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(50, period=8, seed=0, max_len=96)
    once = BatchSchedule(samples, 256, 16, seed=3, max_batches=30)
    thrice = BatchSchedule(samples, 256, 16, seed=3, max_batches=90, repeats=3)
    rows, batches = list(once.iter_from(0)), list(thrice.iter_from(0))
    assert [b.index for b in batches] == list(range(90))
    for i, b in enumerate(batches):
        row = rows[i // 3]
        assert thrice.row_of(b.index) == i // 3 and b.epoch == row.epoch
        assert torch.equal(b.input_ids, row.input_ids) and torch.equal(b.loss_mask, row.loss_mask)
    for r in range(30):
        group = batches[3 * r: 3 * r + 3]
        assert not torch.equal(group[0].anchors, group[1].anchors) and not torch.equal(group[1].anchors,
                                                                                         group[2].anchors)
    for start in (1, 44, 89):
        got = list(thrice.iter_from(start))
        assert [b.index for b in got] == list(range(start, 90))
        for a, b in zip(got, batches[start:]):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        BatchSchedule(samples, 256, 16, seed=3, max_batches=1, repeats=0)


def test_fixed_rows_train_epoch_zeros_rows_in_a_fresh_order_and_name_them_alike():
    """train.feature_cache_gb: every epoch trains epoch 0's rows (the schedule without fixed rows gives the same
    epoch 0), shuffled per epoch; row_of names a batch's row by its place in epoch 0, so batches that row_of calls
    the same hold the same tokens; a resumed schedule gives the same batches."""
    from dflash_train.data.packing import BatchSchedule
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(40, period=8, seed=0, max_len=96)
    plain = BatchSchedule(samples, 256, 16, seed=3, max_batches=1)
    fixed = BatchSchedule(samples, 256, 16, seed=3, max_batches=70, fixed_rows=True, repeats=2)
    n = fixed.rows_per_epoch
    assert n == plain.rows_per_epoch and 70 > 2 * 2 * n  # more than two epochs of two batches a row
    batches = list(fixed.iter_from(0))
    first = list(plain.iter_from(0))[0]
    assert torch.equal(batches[0].input_ids, first.input_ids)  # epoch 0 as packed without fixed rows
    tokens_of = {}
    for b in batches:
        row = fixed.row_of(b.index)
        assert 0 <= row < n
        if row in tokens_of:
            assert torch.equal(tokens_of[row], b.input_ids), f"row {row} changed its tokens"
        tokens_of[row] = b.input_ids
    per_epoch = [[fixed.row_of(i) for i in range(e * 2 * n, (e + 1) * 2 * n, 2)] for e in range(2)]
    assert per_epoch[0] == list(range(n)) and sorted(per_epoch[1]) == list(range(n)) and per_epoch[1] != per_epoch[0]
    assert len({b.anchors.tolist().__str__() for b in batches if fixed.row_of(b.index) == 0}) > 1  # fresh anchors
    resumed = list(BatchSchedule(samples, 256, 16, seed=3, max_batches=70, fixed_rows=True,
                                 repeats=2).iter_from(33))
    for a, b in zip(resumed, batches[33:]):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))



def test_a_schedule_reuses_another_schedules_flat_samples(monkeypatch):
    """build_run sizes the epoch with one schedule and trains with another: the second takes the first's flat arrays
    (built once for both) and gives exactly the batches it would have built them for itself."""
    import dflash_train.data.packing as packing
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(40, period=8, seed=0, max_len=96)
    alone = list(packing.BatchSchedule(samples, 256, 16, seed=3, max_batches=30, fixed_rows=True).iter_from(0))
    built = []
    real = packing.FlatSamples
    monkeypatch.setattr(packing, "FlatSamples", lambda s: built.append(1) or real(s))
    sizing = packing.BatchSchedule(samples, 256, 16, seed=3, max_batches=1)
    assert sizing.rows_per_epoch > 0
    training = packing.BatchSchedule(samples, 256, 16, seed=3, max_batches=30, fixed_rows=True,
                                     flat=sizing.flat_samples())
    batches = list(training.iter_from(0))
    assert len(built) == 1
    for a, b in zip(batches, alone, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))

@pytest.mark.parametrize("n,block", [(1, 32), (7, 32), (32, 32), (33, 32), (1000, 32), (2693, 32), (50, 8)])
def test_spread_order_is_a_permutation_whose_blocks_share_every_suffix_of_ids_evenly(n, block):
    """A later epoch's row order (fixed rows, train.feature_cache_gb): random, but every `block` consecutive places
    hold the same number of ids at or past any c, give or take one (the rows past the cache's capacity), so no log
    window gets more target forwards than the next by chance."""
    import random

    from dflash_train.data.packing import spread_order

    order = spread_order(n, block, random.Random(1))
    assert sorted(order) == list(range(n))
    assert order == spread_order(n, block, random.Random(1))  # seeded
    assert n < 3 or order != spread_order(n, block, random.Random(2))
    full = [order[i:i + block] for i in range(0, n - block + 1, block) if n >= block]
    full = [b for b in full if len(b) == block][: n // block]
    for c in range(0, n, max(1, n // 37)):
        counts = [sum(i >= c for i in b) for b in full]
        if counts:
            assert max(counts) - min(counts) <= 1, (c, counts)


def test_row_features_keep_the_first_rows_that_fit_and_serve_them_again():
    """RowFeatures with a byte budget: each row's features are computed once while the budget holds them, the rows
    beyond it every time they come back; the last row is always reused by its consecutive batches."""
    from dflash_train.models.feature_cache import RowFeatures

    row_bytes = 4 * 6 * 4  # a [4, 6] float32 tensor
    rows = RowFeatures(lambda index: index // 2 % 3, budget_bytes=2 * row_bytes)  # 3 rows, 2 kept; 2 batches a row
    calls = []

    def compute(row):
        calls.append(row)
        return torch.full((4, 6), float(row))

    for index in range(18):  # three passes over the three rows
        feats = rows(index, lambda: compute(index // 2 % 3))
        assert torch.equal(feats, torch.full((4, 6), float(index // 2 % 3)))
    assert rows.capacity == 2 and sorted(rows.kept) == [0, 1]
    assert calls == [0, 1, 2, 2, 2]  # rows 0 and 1 once, row 2 once a pass
    assert rows.computed == 5 and rows.served == 4  # rows 0 and 1 in passes two and three
    assert "kept 2 rows" in rows.summary()


def test_row_features_spill_the_rows_past_the_device_budget_to_host_memory():
    """train.feature_cache_host_gb: the first rows fill the device's share, the next ones the host's, the rest are
    computed every pass; a host row comes back on the rows' device with the same values."""
    from dflash_train.models.feature_cache import RowFeatures

    row_bytes = 4 * 6 * 4
    rows = RowFeatures(lambda index: index % 4, budget_bytes=1 * row_bytes, host_budget_bytes=2 * row_bytes)
    calls = []

    def compute(row):
        calls.append(row)
        return torch.full((4, 6), float(row))

    served = {}
    for index in range(12):  # three passes over four rows, one batch a row
        feats = rows(index, lambda: compute(index % 4))
        assert torch.equal(feats, torch.full((4, 6), float(index % 4)))
        served.setdefault(index % 4, []).append(feats)
    assert rows.capacity == 1 and rows.host_capacity == 2
    assert sorted(rows.kept) == [0] and sorted(rows.kept_host) == [1, 2]
    assert calls == [0, 1, 2, 3, 3, 3]  # row 3 fits nowhere
    assert rows.computed == 6 and rows.served == 6 and rows.served_host == 4
    assert served[0][1] is served[0][0] and served[1][1].device == served[1][0].device  # back on the rows' device
    assert "+ 2 in host memory" in rows.summary() and "4 rows served from there" in rows.summary()
    rows.release()
    assert not rows.kept and not rows.kept_host
    only_host = RowFeatures(lambda index: index % 2, budget_bytes=0, host_budget_bytes=5 * row_bytes)
    for index in range(4):
        only_host(index, lambda: compute(index % 2))
    assert only_host.capacity == 0 and sorted(only_host.kept_host) == [0, 1] and only_host.computed == 2


def test_the_copier_runs_on_a_small_team_and_leaves_every_other_thread_alone(monkeypatch):
    """The host tier's copier does its intra-op work (faulting a row's pages in) on COPY_THREADS threads, not on
    every core; the count a thread yet to start takes, and the caller's own, stay what they were."""
    import threading

    from dflash_train.models.feature_cache import RowFeatures

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("a team per thread is OpenMP's; other backends keep one pool")
    monkeypatch.setattr(RowFeatures, "COPY_THREADS", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # the suite runs on one (conftest); OpenMP takes more threads than cores
    try:
        rows = RowFeatures(lambda index: index, budget_bytes=0, host_budget_bytes=2**20, name="target0")
        rows(0, lambda: torch.ones(4, 6))
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert rows._copier.submit(torch.get_num_threads).result() == 2
        assert later == [3] and torch.get_num_threads() == 3
        assert torch.equal(rows.kept_host[0].result(), torch.ones(4, 6))
        rows.release()
    finally:
        torch.set_num_threads(before)


def test_host_memory_available_is_capped_by_every_cgroup_limit(tmp_path):
    """A container's /proc/meminfo shows the whole machine: the host tier's size must also respect the memory limit
    of the process's cgroup and its ancestors (v2 and v1), the reclaimable page cache not counted as used."""
    from dflash_train.models.feature_cache import host_memory_available

    gib = 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {512 * gib // 1024} kB\nMemAvailable: {400 * gib // 1024} kB\n")

    def group(path, limit, used, cache=0, v1=False):
        d = tmp_path / "cg" / ("memory" if v1 else "") / path
        d.mkdir(parents=True, exist_ok=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
        (d / names[0]).write_text(f"{limit}\n")
        (d / names[1]).write_text(f"{used}\n")
        (d / "memory.stat").write_text(f"{'total_inactive_file' if v1 else 'inactive_file'} {cache}\nanon 1\n")

    def available(cgroup_lines):
        (tmp_path / "self_cgroup").write_text(cgroup_lines)
        return host_memory_available(str(meminfo), str(tmp_path / "cg"), str(tmp_path / "self_cgroup")) / gib

    assert available("0::/\n") == 400                          # no limit files: MemAvailable
    assert available("garbage\n\n") == 400                      # lines it cannot read are passed over
    group("", "max", 10 * gib)
    group("job", 100 * gib, 70 * gib, cache=20 * gib)           # 100 - (70 - 20 cached)
    assert available("0::/job\n") == 50
    group("job/step", "max", 60 * gib)                          # no limit of its own: the parent's still holds
    assert available("0::/job/step\n") == 50
    group("job/step", 30 * gib, 10 * gib)                       # the tighter of the two
    assert available("0::/job/step\n") == 20
    group("box", 2**63 - 4096, gib, v1=True)                    # v1's "unlimited" and a v1 limit above it
    group("box/task", 64 * gib, 16 * gib, cache=8 * gib, v1=True)
    assert available("4:memory:/box/task\n3:cpu:/\n0::/\n") == 56
    group("full", 8 * gib, 9 * gib)                             # over its limit already: nothing, not negative
    assert available("0::/full\n") == 0
    assert host_memory_available(str(tmp_path / "none"), str(tmp_path / "cg"), str(tmp_path / "none")) == float("inf")


def test_host_tiers_of_one_process_share_the_memory_the_host_can_spare(monkeypatch):
    """Several target devices each size their host tier at their first row, before any has filled it: the second
    gets what the first left, not the whole; a released tier, or one no longer referenced (a failed run), gives its
    share back."""
    import gc

    from dflash_train.models import feature_cache as cache_mod
    from dflash_train.models.feature_cache import RowFeatures

    row_bytes = 4 * 6 * 4
    monkeypatch.setattr(RowFeatures, "HOST_HEADROOM", 0)
    monkeypatch.setattr(cache_mod, "host_memory_available", lambda: 10 * row_bytes)

    def tier():
        rows = RowFeatures(lambda index: index, budget_bytes=0, host_budget_bytes=7 * row_bytes)
        rows(0, lambda: torch.zeros(4, 6))
        return rows

    first, second = tier(), tier()
    assert (first.host_capacity, second.host_capacity) == (7, 3)
    first.release()
    third = tier()                                  # 10 less the second's 3
    assert third.host_capacity == 7
    del third                                       # never released, as after a failed run
    gc.collect()
    assert tier().host_capacity == 7
    second.release()


def test_row_features_copy_rows_out_in_the_background(monkeypatch):
    """The copy to host memory runs in a thread of its own: the worker returns while it is still running, a later
    pass gets the row back from it, and a failed copy raises in the worker rather than vanishing."""
    import threading

    from dflash_train.models import feature_cache as cache_mod
    from dflash_train.models.feature_cache import RowFeatures

    row_bytes = 4 * 6 * 4
    gate, names, real = threading.Event(), [], cache_mod._host_copy

    def held_copy(feats, ready, stream):
        names.append(threading.current_thread().name)
        assert gate.wait(timeout=60), "the test never opened the gate"
        return real(feats, ready, stream)

    monkeypatch.setattr(cache_mod, "_host_copy", held_copy)
    rows = RowFeatures(lambda index: index % 3, budget_bytes=0, host_budget_bytes=3 * row_bytes, name="target0")
    for index in range(3):                       # the first pass returns with every copy still held at the gate
        rows(index, lambda: torch.full((4, 6), float(index)))
    assert sorted(rows.kept_host) == [0, 1, 2] and not any(f.done() for f in rows.kept_host.values())
    gate.set()
    for index in range(3, 6):                    # the second pass: every row from host memory, no forward
        assert torch.equal(rows(index, lambda: None), torch.full((4, 6), float(index % 3)))
    assert rows.computed == 3 and rows.served_host == 3
    assert names and all(n.startswith("target0-copy-out") for n in names)
    rows.release()

    def failing_copy(feats, ready, stream):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache_mod, "_host_copy", failing_copy)
    monkeypatch.setattr(RowFeatures, "MAX_PENDING_COPIES", 0)   # every copy awaited at once: the error is the call's
    rows = RowFeatures(lambda index: index, budget_bytes=0, host_budget_bytes=3 * row_bytes)
    with pytest.raises(RuntimeError, match="copy failed"):
        rows(0, lambda: torch.zeros(4, 6))
    rows.release()
