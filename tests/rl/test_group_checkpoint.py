"""A learner group's checkpoint on 2 CPU ranks (gloo, FSDP2), measured tensor by tensor on rank 1.

- saving gathers the optimizer state (and the masters) to rank 0 alone: every tensor rank 1 creates
  during the save is at most its own padded shard, while `full_tensor()`, the positive control, creates
  the full tensor there; rank 0 gets the full tensors, which the same optimizer.pt format holds
- resuming memory-maps optimizer.pt on every rank, and each rank copies out its own rows only: rank 1
  creates nothing larger than its shard, and the loaded state equals the saved one exactly
- the learner reads optimizer.pt with torch.load(..., mmap=True)
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from worker_procs import run_ranks

WORLD = 2


class Tiny(torch.nn.Module):
    """Rows that split evenly (10 over 2), unevenly (3: 2 + 1) and leave rank 1 empty (1: 1 + 0)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 10, dtype=torch.float64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(10, 10, dtype=torch.float64) for _ in range(2))
        self.out = torch.nn.Linear(10, 3, dtype=torch.float64)
        self.gain = torch.nn.Parameter(torch.ones(1, 3, dtype=torch.float64))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h) * self.gain


class Created(TorchDispatchMode):
    """The largest tensor any op creates while active (a DTensor counts its local part: what this rank holds)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, (t.to_local() if isinstance(t, DTensor) else t).numel())
        return out


def _model_and_opt(group, seed: int):
    torch.manual_seed(seed)
    model = Tiny()
    group.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _rank(rank: int, store: str, path: str, q) -> None:
    try:
        from tsrl_cli.rl.group import LearnerGroup
        from tsrl_cli.rl.masters import MASTER_KEY
        from tsrl_cli.rl.ranks import Policy, ShardedRanks

        torch.set_num_threads(1)
        group = LearnerGroup.join(rank, WORLD, "cpu", store)
        ranks = ShardedRanks(group)
        model, opt = _model_and_opt(group, 0)
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        params = list(model.parameters())
        policy = Policy(model, None, None, None, params, None)
        shard = max(-(-t.shape[0] // WORLD) * math.prod(t.shape[1:]) for s in opt.state.values()
                    for t in s.values() if isinstance(t, DTensor))
        full = max(t.numel() for s in opt.state.values() for t in s.values() if isinstance(t, DTensor))

        with Created() as saving:
            sd = ranks.optimizer_state(opt, policy, masters=True)
        with Created() as control:  # every rank holding full copies: what the save must not do
            expected = {i: {k: v.full_tensor() for k, v in s.items() if isinstance(v, DTensor)}
                        for i, s in enumerate(opt.state.values())}
        masters = [p.full_tensor() for p in params]
        if rank == 0:
            assert sd is not None and set(sd["state"]) == set(expected)
            for i, s in expected.items():
                for k, v in s.items():
                    got = sd["state"][i][k]
                    assert got.device.type == "cpu" and got.shape == v.shape and torch.equal(got, v), (i, k)
            assert all(torch.equal(sd[MASTER_KEY][i], m) for i, m in enumerate(masters))
            torch.save(sd, path)
        else:
            assert sd is None
        group.barrier()

        again, opt2 = _model_and_opt(group, 7)  # other values: everything must come from the file
        policy2 = Policy(again, None, None, None, list(again.parameters()), None)
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        with Created() as loading:
            ranks.load_optimizer(opt2, loaded, policy2)
        for (p, s), (p2, s2) in zip(opt.state.items(), opt2.state.items(), strict=True):
            assert torch.equal(p.to_local(), p2.to_local())  # the masters
            for k, v in s.items():
                v2 = s2[k]
                if isinstance(v, DTensor):
                    assert isinstance(v2, DTensor) and v2.placements == v.placements
                    assert torch.equal(v.to_local(), v2.to_local()), k
                else:
                    assert torch.equal(v, v2), k
        q.put(("ok", rank, {"saving": saving.largest, "loading": loading.largest, "control": control.largest,
                            "shard": shard, "full": full}))
        group.close()
    except BaseException:  # noqa: BLE001 - the test reports it
        q.put(("error", rank, traceback.format_exc()))


@pytest.mark.slow  # two spawned ranks import torch and tsrl: 40 s on a loaded 2-core machine
def test_only_rank_0_holds_the_full_state_when_saving_and_each_rank_reads_its_rows_when_loading(tmp_path):
    store, path = str(tmp_path / "store"), str(tmp_path / "optimizer.pt")
    got = run_ranks(_rank, lambda r: (r, store, path), WORLD, timeout_s=180)
    one = got[1]
    assert one["shard"] < one["full"]  # the sizes tell a shard from a full tensor
    assert one["control"] >= one["full"]  # the probe sees a full copy where one is made
    assert one["saving"] <= one["shard"], one  # the save: rank 1 never held more than its own rows
    assert one["loading"] <= one["shard"], one  # the resume: rank 1 read its own rows only


def test_the_learner_memory_maps_optimizer_pt(toy_policies, tmp_path, monkeypatch):
    """A resume reads optimizer.pt through a memory map (every rank of a group does the same)."""
    from toy_workload import TOY

    from tsrl_cli.config import load_config
    from tsrl_cli.rl import learner_worker
    from tsrl_cli.rl.learner_worker import Learner

    def make(run_dir, init_dir=None):
        cfg = load_config(sets=[*TOY, f"run.out={run_dir}"])
        policy = str(toy_policies[0])
        return Learner(cfg, init_dir or policy, policy, 0, str(run_dir), None, None, None)

    lrn = make(tmp_path / "a")
    lrn.apply_step([torch.ones(p.shape) for p in lrn.params])
    ckpt = lrn.save_checkpoint(1)
    calls = []
    load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(learner_worker.torch, "load", spy)
    again = make(tmp_path / "b", ckpt)
    assert [c.get("mmap") for c in calls] == [True]
    for a, b in zip(lrn.opt.state.values(), again.opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
