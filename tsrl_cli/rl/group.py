"""A learner of N ranks: FSDP2 shards the parameters, gradients, optimizer state and every streaming buffer.

Each rank is one process on one device (`--learner-devices 4-7` on GPUs, `cpu:N` for N CPU ranks,
gloo there and NCCL on GPUs). FSDP2 (`fully_shard` of each decoder layer, then of the root) runs
every forward and backward in lockstep: all ranks all-gather a layer's parameters together, and
after each backward every layer's gradient leaves through one reduce-scatter. Streaming needs
more than a sum: the ranks backward different arrivals of different groups, whose sums S_r and
S_1 must stay apart until their group closes. So the reduce-scatter is replaced (FSDP2's public
`set_custom_reduce_scatter`) by an all-to-all of the same bytes: rank d receives every source
rank's piece of its own shard, and folds the piece of source j into j's target (its group's
S_r and S_1, a unit buffer, or the round buffer R) with j's scalar. Every buffer is therefore held
in the sharded layout: 1/N of it on each rank. The design and its arithmetic: docs/distributed.md.

    LearnerGroup.join(rank, world, store, device)    torch.distributed (FileStore, or env:// under torchrun)
    group.shard(model)                               fully_shard + the folding all-to-all on every unit
    ShardedGrads                                      the round learner's backend on a group (rl/learner.py)
    group.broadcast / gather / barrier                control messages: their own gloo group, no practical timeout
    group.full_trainable_state(model)                 gathered on rank 0: publishing and checkpoints
    group.optimizer_state / load_optimizer_state      the single-process optimizer.pt format: resume on any N

Two process groups: the default one (NCCL on GPUs, gloo on CPUs) carries the compute collectives (FSDP's
all-gathers, the folding all-to-all, the gathers of full tensors) under learner.collective_timeout_s; a gloo
group of its own carries the control messages, where a rank may wait as long as a round takes (rank 0
reading the first arrival, or writing a checkpoint) without the timeout tearing the process down.

The pieces a rank receives are exactly the rows FSDP's own reduce-scatter would sum (the flat,
dim-0-padded layout of each unit's parameters with gradients); the round's gradient is handed back
to FSDP at round close by one more lockstep pass whose "reduce-scatter" returns R, so FSDP itself
maps it onto the sharded `p.grad`. tsrl never reads FSDP's private layout.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tsrl_cli.policy import decoder_layers  # the FSDP units: each decoder layer, then the root

Fold = tuple | None  # ("member", group_id, reward) | ("unit", key) | ("round", scale) | None (nothing)

# learner.collective_timeout_s's default: a compute collective that waits longer fails (a dead rank is usually
# seen sooner: its sockets close). Compute collectives only start once every rank is there (a control message
# precedes each run of them), so this bounds the collectives themselves, never a wait for rank 0.
COLLECTIVE_TIMEOUT_S = 600.0
# the control group's: no practical limit. A rank waits there while rank 0 waits for the round's first arrival
# (engine compile, sandboxes, 50-turn trajectories) or writes a checkpoint; a dead rank 0 closes its sockets.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


def _arrive(store, world: int) -> None:
    """Wait until all `world` ranks reached the store, however long each took to start: the group's own
    rendezvous (under the compute timeout) then never waits for a late starter."""
    if store.add("tsrl-arrived", 1) == world:
        store.set("tsrl-all-arrived", "1")
    store.wait(["tsrl-all-arrived"], CONTROL_TIMEOUT)


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (env:// rendezvous), else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


@dataclass
class LearnerGroup:
    rank: int
    world: int
    device: str
    control: object = None  # the gloo group of control messages (None: the default group, as a traced group has)

    @classmethod
    def join(cls, rank: int, world: int, device: str, store_path: str | None = None,
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> LearnerGroup:
        """Join the group: a FileStore at `store_path` (ranks tsrl started itself) or env:// (torchrun).
        timeout_s: the compute collectives' limit (learner.collective_timeout_s); control messages have none."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if store_path is not None:
            store = dist.FileStore(store_path, world)
            _arrive(store, world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        return cls(rank, world, device, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- sharding --------------------------------------------------------------------------------
    def shard(self, model, grads: ShardedGrads | None = None, load_one_at_a_time: bool = False,
              compute_dtype: torch.dtype | None = None, mesh=None):
        """fully_shard every decoder layer, then the root, each with the folding all-to-all (when `grads`).

        Sum reduction, no division: FSDP's default averages over ranks, streaming sums exact partial sums.
        compute_dtype (master weights, rl/masters.py): the sharded parameters are the float32 masters, and
        FSDP2's MixedPrecisionPolicy all-gathers each unit in compute_dtype (bf16) for the forward and
        backward; gradients reach the reduce-scatter in the masters' dtype (FSDP copies the bf16 gradients
        in, exactly), and the all-to-all carries them as compute_dtype, losslessly, so a pass moves the bytes
        it moves without masters and the round's gradient reaches the sharded p.grad unrounded.
        mesh: a device mesh made beforehand (tsrl plan makes it outside FakeTensorMode, which cannot build one).
        """
        mesh = mesh if mesh is not None else init_device_mesh(self.device.split(":")[0], (self.world,))
        units = [*decoder_layers(model), model]
        mp = {}
        if compute_dtype is not None:
            masters = next(p.dtype for p in model.parameters() if p.requires_grad)
            mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=masters)}
        for u in units:
            fully_shard(u, mesh=mesh, **mp)
        if grads is not None:
            grads.attach(units, wire_dtype=compute_dtype)
        return model

    # ---- control messages: the gloo control group ------------------------------------------------
    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled; small things: arrivals, plans, decisions)."""
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    # ---- full states on rank 0 -------------------------------------------------------------------
    def full_trainable_state(self, model, dtypes: dict[str, torch.dtype] | None = None,
                             into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """{name: full tensor} of the trained parameters on rank 0 (None elsewhere); a collective.
        dtypes: each one's dtype on arrival (every rank casts its own shard before it travels; None: as held).
        into: rank 0's destination per name, filled by one copy out of the gather and returned (None: new CPU
        tensors)."""
        out = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                full = self.to_leader(p, None if dtypes is None else dtypes[n], None if into is None else into[n])
                if self.leader:
                    out[n] = full
        return out if self.leader else None

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict | None:
        """opt.state_dict() as a single process holds it (full tensors, parameters numbered in order), on rank 0;
        a collective. Each tensor is gathered to rank 0 alone: no other rank holds more than its own shards."""
        sd = opt.state_dict()
        state = {}
        for i, s in sd["state"].items():
            full = {k: self.to_leader(v) if torch.is_tensor(v) else v for k, v in s.items()}
            if self.leader:
                state[i] = full
        return {"state": state, "param_groups": sd["param_groups"]} if self.leader else None

    def to_leader(self, t: torch.Tensor, dtype: torch.dtype | None = None,
                  into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The full value of `t` on rank 0 (None elsewhere): in `into` (one copy), else on the host; a collective
        for a DTensor. dtype: cast on each rank, shard by shard, before anything travels.

        A DTensor sharded on dim 0 (FSDP2's parameters and their optimizer state) travels by one dist.gather:
        each rank sends its rows, padded to the chunk of ceil(rows / N), and only rank 0 receives, into one
        (N x chunk)-row buffer on its device. Other layouts fall back to full_tensor(), which every rank holds
        until it returns. A plain tensor (AdamW's step) is its own full value."""
        if dtype is not None and t.dtype != dtype:
            t = t.detach().to(dtype)
        if not _is_dtensor(t) or not _rows_sharded(t):
            full = (t.full_tensor() if _is_dtensor(t) else t).detach()
            if not self.leader:
                return None
            return into.copy_(full) if into is not None else full.cpu()
        local = t.to_local().detach()
        rows, n = t.shape[0], self.world
        chunk = -(-rows // n)
        mine = _chunk_rows(rows, n, self.rank)
        if local.shape[0] != mine:
            raise RuntimeError(f"a sharded tensor of {rows} rows holds {local.shape[0]} on rank {self.rank}, expected "
                               f"{mine} (torch.chunk's split over {n} ranks): not the layout this gather reads")
        send = local
        if mine != chunk or not local.is_contiguous():  # the last ranks' chunks are short (or empty): padded
            send = torch.zeros((chunk, *t.shape[1:]), dtype=local.dtype, device=local.device)
            send[:mine] = local
        if not self.leader:
            dist.gather(send, None, dst=0)
            return None
        buf = torch.empty((n * chunk, *t.shape[1:]), dtype=local.dtype, device=local.device)
        dist.gather(send, list(buf.view(n, chunk, *t.shape[1:]).unbind(0)), dst=0)
        full = buf[:rows]  # rank r's rows start at r x chunk: the first `rows` are the tensor
        if into is not None:
            return into.copy_(full)
        return full if full.device.type == "cpu" else full.cpu()

    def load_optimizer_state(self, opt: torch.optim.Optimizer, sd: dict, masters: dict | None = None) -> None:
        """Load a single-process optimizer.pt into the sharded optimizer; no collective.
        sd: torch.load(..., mmap=True) of the file on every rank; each rank copies only its own rows of each
        tensor out of the mapping (the pages it reads), so no rank holds a full moment in memory.
        `masters` ({index: full tensor}, optimizer.pt's master_weights): the optimizer's parameters' values."""
        params = [p for g in opt.param_groups for p in g["params"]]
        state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            state[i] = {k: (_shard_of(v, p) if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0
                            else v.clone() if torch.is_tensor(v) else v)
                        for k, v in s.items()}
        opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
        with torch.no_grad():
            for i, t in (masters or {}).items():
                p = params[int(i)]
                p.copy_(_shard_of(t, p, p.dtype))


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def _rows_sharded(t: DTensor) -> bool:
    """Sharded on dim 0 over a 1-D mesh (FSDP2's layout), the one layout to_leader and _shard_of slice by rows."""
    return t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.dim() > 0


def _chunk_rows(rows: int, n: int, rank: int) -> int:
    """Rows of a dim-0 shard on `rank` of `n` (torch.chunk's split, DTensor's Shard(0)): ceil(rows / n) each,
    the last ranks' short or empty."""
    chunk = -(-rows // n)
    return max(0, min(chunk, rows - rank * chunk))


def _shard_of(full: torch.Tensor, p: DTensor, dtype: torch.dtype | None = None) -> DTensor:
    """`p`'s shard of the full CPU tensor `full` (a memory map: only these rows are read), as a DTensor laid out
    like `p`, on p's device, in `dtype` (None: full's), in memory of its own."""
    dtype = dtype or full.dtype
    if not _rows_sharded(p):
        return distribute_tensor(full.to(p.device, dtype), p.device_mesh, p.placements)
    n, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-full.shape[0] // n)
    rows = full.narrow(0, min(rank * chunk, full.shape[0]), _chunk_rows(full.shape[0], n, rank))
    local = rows.to(p.device, dtype, copy=True)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


# ---- the backend: one lockstep pass per backward, folding per source rank -------------------------


class _FoldingAllToAll:
    """FSDP2's reduce-scatter for one unit, replaced: all-to-all, then fold each source's piece.

    input (N*S,): this rank's full unsharded gradient of the unit, laid out by FSDP as N chunks of S
    (chunk d goes to rank d). After the all-to-all, row j of (N, S) is source j's piece of this
    rank's shard: the same bytes as one reduce-scatter, but not yet summed.
    """

    def __init__(self, owner: ShardedGrads, index: int):
        self.owner, self.index = owner, index

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.owner._reduce(self.index, output_tensor, input_tensor, group)  # synchronous: no Work handle


class ShardedGrads:
    """Gradients of a sharded model, delivered per source rank to the round learner's accumulator.

    templates: one flat tensor per FSDP unit, this rank's shard (1/N of the unit's trainable
    parameters, dim-0 padded as FSDP pads them): the accumulator's buffers take these shapes.
    """

    def __init__(self, group: LearnerGroup, model):
        self.group, self.model = group, model
        self.units: list = []
        self.templates: list[torch.Tensor] = []
        self._folds: Sequence[Fold] = ()
        self._fold: Callable[[Fold, list], None] | None = None
        self._emit: list[torch.Tensor] | None = None
        self.passes = 0
        self.wire_dtype: torch.dtype | None = None  # what the all-to-all carries (None: the reduce-scatter input's)

    def attach(self, units, wire_dtype: torch.dtype | None = None) -> None:
        n = self.group.world
        self.wire_dtype = wire_dtype
        self.units = list(units)
        seen: set[int] = set()  # the root comes last in `units`: its own parameters are those no layer holds
        owned: list[list[torch.nn.Parameter]] = []
        for u in self.units:
            ps = [p for p in u.parameters() if id(p) not in seen]
            seen.update(id(p) for p in ps)
            owned.append([p for p in ps if p.requires_grad])
        for i, (u, ps) in enumerate(zip(self.units, owned, strict=True)):
            # FSDP pads dim 0 to a multiple of N; rank d's chunk is rows [d*c, (d+1)*c) of every parameter
            numel = sum(-(-p.shape[0] // n) * (p.numel() // max(p.shape[0], 1)) for p in ps)
            p0 = ps[0] if ps else next(u.parameters())
            self.templates.append(torch.empty(numel, dtype=p0.dtype, device=self.group.device))
            u.set_custom_reduce_scatter(_FoldingAllToAll(self, i))
            u.set_gradient_divide_factor(1.0)
            u.set_force_sum_reduction_for_comms(True)

    # called by FSDP during backward, once per unit
    def _reduce(self, index: int, output, input_, pg) -> None:
        n = self.group.world
        if input_.numel() != n * self.templates[index].numel():
            raise RuntimeError(f"FSDP unit {index}: reduce-scatter input of {input_.numel()} elements, expected "
                               f"{n} x {self.templates[index].numel()}; this torch's FSDP2 layout is not the one "
                               "tsrl's sharded learner was written for")
        if self._emit is not None:  # round close: hand R to FSDP, which maps it onto p.grad
            output.copy_(self._emit[index])
            return
        wire = input_ if self.wire_dtype is None else input_.to(self.wire_dtype)  # bf16 values: exact both ways
        recv = torch.empty_like(wire)
        dist.all_to_all_single(recv, wire, group=pg)
        pieces = recv.view(n, -1)
        grads: list[torch.Tensor | None] = [None] * len(self.templates)
        for j, fold in enumerate(self._folds):
            if fold is not None:
                grads[index] = pieces[j]
                self._fold(fold, grads)
        output.zero_()

    def backward(self, losses: Sequence[torch.Tensor], folds_by_rank: Sequence[Sequence[Fold]],
                 fold: Callable[[Fold, list], None]) -> None:
        """One lockstep pass per loss: losses[k] is this rank's k-th loss (same forward), folds_by_rank[k][j]
        where source rank j's k-th gradient goes. Every rank calls this with the same number of losses."""
        self._fold = fold
        for k, loss in enumerate(losses):
            self._folds = folds_by_rank[k]
            loss.backward(retain_graph=k < len(losses) - 1)
            self.passes += 1
            for p in self.model.parameters():  # FSDP stored our zero output as p.grad: drop it
                p.grad = None
        self._folds, self._fold = (), None

    def emit(self, buffers: list[torch.Tensor], dummy_loss: Callable[[], torch.Tensor]) -> None:
        """Round close: one lockstep pass whose reduce-scatter returns `buffers` (R, this rank's shard),
        which FSDP writes into the sharded p.grad of every trainable parameter."""
        for p in self.model.parameters():
            p.grad = None
        self._emit = buffers
        try:
            dummy_loss().backward()
        finally:
            self._emit = None
