"""The learner's ranks: one process, or a sharded group, behind one interface chosen once at start.

    LearnerRanks      what the learner asks of its ranks: who leads, broadcast and gather, loading the
                      policy (and its gradient backend), the optimizer's full state, the full weights
    OneProcess        one process holds the whole model on its device; collectives are identities
    ShardedRanks      N processes (rl/group.py LearnerGroup): FSDP2 shards, rank 0 keeps a host copy
                      of the policy to checkpoint (refreshed when one is written) and publishes gathers
    ranks_of(group)   the implementation for a joined group, or OneProcess for none

The learner process (rl/learner_worker.py) reads as one path over this interface; every difference
between one process and a group lives here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tsrl_cli.core.graddiff import combine, compare
from tsrl_cli.policy import checkpoint_activations, load_policy, trainable_state
from tsrl_cli.rl.group import LearnerGroup, ShardedGrads
from tsrl_cli.rl.masters import MASTER_KEY, MasterWeights, master_state, upcast_for_group


@dataclass
class Policy:
    """The policy being trained on this rank, and what the optimizer steps."""

    model: torch.nn.Module  # on one process: whole, on its device; on a group: this rank's shards
    tokenizer: object
    host: torch.nn.Module | None  # a group's leader: the full policy on the host (checkpointed; the engines' dtypes)
    grads: object | None  # the round learner's gradient backend (None: rl/learner.LocalGrads)
    params: list[torch.nn.Parameter]  # the trained parameters (LoRA: the adapters only)
    masters: MasterWeights | None  # one process with optim.master_dtype: float32 copies the optimizer steps

    @property
    def opt_params(self) -> list[torch.Tensor]:
        return self.masters.tensors if self.masters is not None else self.params

    @property
    def full(self) -> torch.nn.Module:
        """The whole policy where this rank has it (a group's leader: the host copy)."""
        return self.host if self.host is not None else self.model


class LearnerRanks(Protocol):
    rank: int
    world: int

    @property
    def leader(self) -> bool: ...

    def broadcast(self, obj): ...  # rank 0's obj on every rank

    def gather(self, obj) -> list | None: ...  # every rank's obj on rank 0, in rank order (None elsewhere)

    def barrier(self) -> None: ...

    def load(self, init_dir: str, load: dict, device: str, checkpointing: bool,
             masters: torch.dtype | None) -> Policy: ...

    def load_reference(self, policy_dir: str, dtype: str, device: str) -> torch.nn.Module: ...

    def load_optimizer(self, opt: torch.optim.Optimizer, sd: dict, policy: Policy) -> None: ...

    def optimizer_state(self, opt: torch.optim.Optimizer, policy: Policy, masters: bool) -> dict | None: ...

    def trained_state(self, policy: Policy) -> dict[str, torch.Tensor] | None: ...

    def live_state(self, policy: Policy, copy: bool, into: Callable[[dict], dict] | None = None
                   ) -> dict[str, torch.Tensor] | None: ...

    def engine_options(self) -> dict: ...

    def hand_over(self, policy: Policy, grads: list, zero_loss) -> list | None: ...

    def compare(self, policy: Policy, lazy: list, candidate: list) -> dict: ...

    def close(self) -> None: ...


class OneProcess:
    """The whole learner in this process."""

    rank, world = 0, 1
    leader = True

    def broadcast(self, obj):
        return obj

    def gather(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def load(self, init_dir, load, device, checkpointing, masters) -> Policy:
        model, tok = load_policy(init_dir, device=device, **load)
        if checkpointing:
            checkpoint_activations(model)
        params = [p for p in model.parameters() if p.requires_grad]
        return Policy(model, tok, None, None, params, MasterWeights(params, masters) if masters is not None else None)

    def load_reference(self, policy_dir, dtype, device):
        return load_policy(policy_dir, dtype=dtype, device=device, tokenizer=False)[0]

    def load_optimizer(self, opt, sd, policy) -> None:
        masters = sd.pop(MASTER_KEY, None)  # the masters it stopped with (their cast is the checkpoint)
        opt.load_state_dict(sd)
        if masters is not None:
            with torch.no_grad():
                for i, t in masters.items():
                    policy.opt_params[int(i)].copy_(t)
            if policy.masters is not None:
                policy.masters.copy_to_params()

    def optimizer_state(self, opt, policy, masters) -> dict:
        sd = opt.state_dict()
        if masters:
            sd[MASTER_KEY] = master_state(policy.opt_params)
        return sd

    def trained_state(self, policy) -> dict[str, torch.Tensor]:
        return {n: t.cpu() for n, t in trainable_state(policy.model).items()}

    def live_state(self, policy, copy, into=None) -> dict[str, torch.Tensor]:
        """The trained tensors to publish: the live ones, on the learner's device; with `copy` (async: its next
        step may come first) a copy, written into `into(specs)` (Publisher.buffers: the bus's buckets on the
        bus's device, which it sends as they lie), or into host tensors without it."""
        state = trainable_state(policy.model)
        if not copy:
            return state
        if into is not None:
            out = into({n: (t.dtype, t.shape) for n, t in state.items()})
        else:
            out = {n: torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for n, t in state.items()}
        return _copy_into(out, state)

    def engine_options(self) -> dict:
        return {}

    def hand_over(self, policy, grads, zero_loss) -> list:
        return grads

    def compare(self, policy, lazy, candidate) -> dict:
        return compare([n for n, p in policy.model.named_parameters() if p.requires_grad], lazy, candidate)

    def close(self) -> None:
        pass


class ShardedRanks:
    """Rank `group.rank` of a learner group: parameters, gradients, optimizer state and buffers sharded."""

    def __init__(self, group: LearnerGroup):
        self.group = group
        self.rank, self.world = group.rank, group.world

    @property
    def leader(self) -> bool:
        return self.group.leader

    def broadcast(self, obj):
        return self.group.broadcast(obj)

    def gather(self, obj) -> list | None:
        return self.group.gather(obj)

    def barrier(self) -> None:
        self.group.barrier()

    def load(self, init_dir, load, device, checkpointing, masters) -> Policy:
        """One rank at a time holds the whole model on the host, then keeps only its shard."""
        for r in range(self.world):
            if r == self.rank:
                model, tok = load_policy(init_dir, device="cpu", **load)
                host = copy.deepcopy(model) if self.leader else None  # checkpoints: the full policy
                if checkpointing:
                    checkpoint_activations(model)  # inside each FSDP unit's hooks (policy.py)
                compute = None  # with masters: the shards are float32, FSDP computes in the model's dtype
                if masters is not None:
                    compute = upcast_for_group([p for p in model.parameters() if p.requires_grad], masters)
                grads = ShardedGrads(self.group, model)
                self.group.shard(model, grads, compute_dtype=compute)
            self.group.barrier()
        # the shards are the masters: no copies beside them
        return Policy(model, tok, host, grads, [p for p in model.parameters() if p.requires_grad], None)

    def load_reference(self, policy_dir, dtype, device):
        ref = load_policy(policy_dir, dtype=dtype, device="cpu", tokenizer=False)[0]
        self.group.shard(ref)
        return ref

    def load_optimizer(self, opt, sd, policy) -> None:
        """A single-process optimizer.pt into the sharded optimizer: `sd` is the file memory-mapped on every rank,
        and each rank copies out only its own rows of each tensor."""
        masters = sd.pop(MASTER_KEY, None)
        self.group.load_optimizer_state(opt, sd, masters)

    def optimizer_state(self, opt, policy, masters) -> dict | None:
        """The single-process format on rank 0 (collectives: every rank calls this); the other ranks hold no more
        than their own shards. The ranks meet on the control group first: rank 0 may come late."""
        self.group.barrier()
        sd = self.group.optimizer_state(opt)
        if masters:  # the shards are the masters: gathered
            full = self.group.full_trainable_state(policy.model)
            if full is not None:
                sd[MASTER_KEY] = dict(enumerate(full.values()))
        return sd

    def trained_state(self, policy) -> dict[str, torch.Tensor] | None:
        """Gathered into rank 0's host copy of the policy (what a checkpoint writes), each shard cast to the
        copy's dtype before it travels (float32 masters arrive as their cast); returns the copy's trained
        tensors on rank 0. The ranks meet on the control group first: rank 0 may come late (from writing a
        checkpoint), and the gathers' timeout is the compute collectives'."""
        self.group.barrier()
        dtypes = self._engine_dtypes(policy)
        into = None
        if self.leader:
            host = dict(policy.host.named_parameters())
            into = {n: host[n].detach() for n in dtypes}
        return self.group.full_trainable_state(policy.model, dtypes, into)

    def live_state(self, policy, copy, into=None) -> dict[str, torch.Tensor] | None:
        """Gathered on rank 0, each shard cast to the engines' dtype before it travels, into `into(specs)`
        (Publisher.buffers: on the learner's GPU for an NCCL bus, page-locked host memory for gloo) or host
        tensors without it: a copy whatever `copy` says. The host copy of the policy is not touched, so a publish
        copies each tensor once: trained_state refreshes the host copy when a checkpoint is written."""
        dtypes = self._engine_dtypes(policy)
        dest = None
        if self.leader and into is not None:
            host = dict(policy.host.named_parameters())
            dest = into({n: (dt, host[n].shape) for n, dt in dtypes.items()})
        return self.group.full_trainable_state(policy.model, dtypes, dest)

    def _engine_dtypes(self, policy) -> dict[str, torch.dtype]:
        """Each trained parameter's dtype in rank 0's host copy, which is the engines' (a float32 master of a
        bf16 model: bf16), on every rank, since each casts its own shards. A control message: the ranks meet
        there, however late rank 0 comes (from joining the weight bus, which waits for the engines to start)."""
        mine = {n: p.dtype for n, p in policy.host.named_parameters() if p.requires_grad} if self.leader else None
        return self.group.broadcast(mine)

    def engine_options(self) -> dict:
        return {"rank": self.rank, "world": self.world}

    def hand_over(self, policy, grads, zero_loss) -> None:
        """R into FSDP's sharded p.grad (one more lockstep pass); the step then reads p.grad."""
        policy.grads.emit(grads, zero_loss)
        return None

    def compare(self, policy, lazy, candidate) -> dict:
        """Each rank compares its own shards (FSDP's flat unit layout, padding rows zero on both sides)."""
        names = [f"FSDP unit {i}, rank {self.rank}'s shard" for i in range(len(lazy))]
        parts = self.group.gather(compare(names, lazy, candidate))
        return self.group.broadcast(combine(parts) if parts is not None else None)

    def close(self) -> None:
        self.group.close()


def _copy_into(out: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """out[name] <- state[name] for every name (copies from a GPU waited for); returns out."""
    with torch.no_grad():
        for n, t in state.items():
            out[n].copy_(t, non_blocking=True)
    for d in {t.device for t in state.values() if t.is_cuda}:
        torch.cuda.synchronize(d)
    return out


def ranks_of(group: LearnerGroup | None) -> LearnerRanks:
    return OneProcess() if group is None else ShardedRanks(group)
