"""The shared-prompt cut (rl/prefix.py): a group's prompt forwarded and backpropagated once, each member's row
starting at the cut with the prompt's keys and values as its past. Float64 equality against the lazy batch
(rl/objective.py lazy_loss: every row whole, verl's agg_loss), in every order and buffer form."""

import copy
import random
from collections import Counter

import pytest
import torch
from grad_compare import grads, rel

from tsrl_cli.config import LossConfig
from tsrl_cli.policy import checkpoint_activations, score_tokens
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rl.prefix import PromptState
from tsrl_cli.rollouts import Rollout

V = 128


def shared_prompt_groups(groups=3, size=5, prompt=12, seed=0, odd_member=True, ref=None):
    """Groups whose members share their prompt token for token, then 1-3 model turns with tool outputs between.
    odd_member: group 0's last member has another prompt (it falls back to an uncut row)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        head = [rng.randrange(V) for _ in range(prompt + g)]
        for i in range(size):
            ids = list(head)
            if odd_member and g == 0 and i == size - 1:
                ids[3] = (ids[3] + 1) % V
            mask, spans = [0] * len(ids), []
            for _ in range(rng.randint(1, 3)):
                s = len(ids)
                ids += [rng.randrange(V) for _ in range(rng.randint(2, 8))]
                mask += [1] * (len(ids) - s)
                spans.append((s, len(ids)))
                if rng.random() < 0.6:
                    n = rng.randint(1, 4)
                    ids += [rng.randrange(V) for _ in range(n)]
                    mask += [0] * n
            reward = [float(rng.random() < 0.5), rng.gauss(0.0, 1.0), 100.0 + 0.01 * rng.gauss(0, 1)][g % 3]
            r = Rollout(f"g{g}", i, ids, mask, reward, spans)
            if ref is not None:
                r.ref_logprobs = score_tokens(ref, ids)
            out.append(r)
    return out


def stream_turns(sl, ro, burst=1):
    """OPD turns round-robin over the trajectories, a learner step after every `burst`; the round's gradient."""
    turns = [(r, k) for k in range(3) for r in ro if k < len(r.turn_spans)]
    for i, (r, k) in enumerate(turns):
        sl.on_turn(r, k)
        if i % burst == burst - 1:
            sl.step()
    sl.drain()
    return sl.close_round()


def opd_round(teacher, ref=None):
    """shared_prompt_groups with the teacher's scores."""
    ro = shared_prompt_groups(ref=ref)
    for r in ro:
        r.teacher_logprobs = score_tokens(teacher, r.input_ids)
    return ro


def run(model, rollouts, obj, *, order_seed=None, drain_each=True, cut=True, **kw):
    sl = StreamLearner(model, obj, Counter(r.group_id for r in rollouts), prefix_cut=cut, **kw)
    order = rollouts if order_seed is None else random.Random(order_seed).sample(rollouts, len(rollouts))
    for r in order:
        sl.on_trajectory(r)
        if drain_each:
            sl.drain()
    sl.drain()
    return sl, sl.close_round()


@pytest.mark.parametrize("loss", [{}, {"adv_norm": "rloo"}, {"adv_norm": "center", "loss_agg": "seq-mean-token-mean"},
                                  {"group_buffers": "buckets", "loss_agg": "seq-mean-token-sum"},
                                  {"kl_coef": 0.1, "entropy_coef": 0.01}])
@pytest.mark.parametrize("schedule", ["stream", "stream-batched", "sync"])
def test_cut_equals_the_lazy_batch(tiny64, teacher64, loss, schedule):
    ro = shared_prompt_groups(ref=teacher64)
    obj = Objective("grpo", LossConfig(**loss))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl, g = run(tiny64, ro, obj, order_seed=3, drain_each=schedule == "stream",
                max_items=1 if schedule == "stream" else None)
    assert rel(g, ref) <= 1e-9
    cut = [b for b in sl.batches if b.prefix is not None]
    assert cut and len(cut) < len(sl.batches)  # the cut ran, and the odd member went uncut
    assert sum(b.prompt for b in sl.batches) == sum(12 + g - 1 for g in range(3))  # one prompt part per group
    assert sl.cut.states == {}  # every prompt part was backpropagated


def test_rows_cover_their_own_tokens_and_one_prompt_per_group(tiny64):
    ro = shared_prompt_groups(groups=2, size=4, prompt=30, odd_member=False)
    obj = Objective("grpo", LossConfig())
    on, _ = run(tiny64, ro, obj, drain_each=False)
    off, _ = run(tiny64, ro, obj, drain_each=False, cut=False)
    own = {r.key: max(j for j, m in enumerate(r.loss_mask) if m) + 1 for r in ro}
    cuts = {"g0": 29, "g1": 30}
    assert sum(b.real_tokens for b in on.batches) == sum(cuts.values()) + sum(own[r.key] - cuts[r.group_id]
                                                                               for r in ro)
    assert sum(b.real_tokens for b in off.batches) == sum(own.values())  # the control: every row whole


def test_dropping_the_prompt_adjoint_is_caught(tiny64, monkeypatch):
    """The positive control: without the prompt's backward the gradient is wrong, so the equality above tests it."""
    ro = shared_prompt_groups()
    obj = Objective("grpo", LossConfig())
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    monkeypatch.setattr(PromptState, "adjoint", lambda self, *_: [torch.zeros_like(t) for t in self.leaves])
    _, g = run(tiny64, ro, obj, order_seed=3)
    assert rel(g, ref) > 1e-3


def test_the_advantage_of_each_class_weights_its_adjoint(tiny64, monkeypatch):
    """A second control: weighting open-group classes by 1 instead of A(r) is caught (stream, open groups)."""
    ro = shared_prompt_groups()
    obj = Objective("grpo", LossConfig())
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    real = PromptState.adjoint
    monkeypatch.setattr(PromptState, "adjoint", lambda self, adv, unit=None: real(self, lambda r: 1.0, unit))
    _, g = run(tiny64, ro, obj, order_seed=3, max_items=1)
    assert rel(g, ref) > 1e-3


@pytest.mark.parametrize("granularity", ["trajectory", "group"])
def test_cut_with_deferred_groups_and_group_granularity(tiny64, granularity):
    """loss.max_open_groups 1: groups past the cap wait for their close and go to R whole-weighted; granularity group
    holds every group's members until its close. Their prompt parts fold through R alone."""
    ro = shared_prompt_groups(groups=4, seed=3)
    obj = Objective("grpo", LossConfig(max_open_groups=1))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl, g = run(tiny64, ro, obj, order_seed=2, max_items=1, granularity=granularity)
    assert rel(g, ref) <= 1e-9 and sl.cut.positions > 0
    assert granularity == "group" or sl.deferred  # the cap held a group back


def test_cut_with_masked_members_and_a_void_group(tiny64):
    """Masked members (an infrastructure failure) are out of the loss; a group left with one valid member contributes
    nothing (its advantages are 0), its prompt adjoint included."""
    ro = shared_prompt_groups(odd_member=False)
    for r in ro:
        r.masked = (r.group_id == "g1" and r.sample_index > 0) or (r.group_id == "g2" and r.sample_index == 2)
    obj = Objective("grpo", LossConfig())
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl, g = run(tiny64, ro, obj, order_seed=7, max_items=1)
    assert rel(g, ref) <= 1e-9 and sl.cut.positions > 0


def test_cut_with_checkpointing_and_the_chunked_head(tiny64):
    model = copy.deepcopy(tiny64)
    checkpoint_activations(model)
    ro = shared_prompt_groups(seed=1)
    obj = Objective("grpo", LossConfig(entropy_coef=0.01))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl, g = run(model, ro, obj, order_seed=5, chunk_tokens=3)
    assert rel(g, ref) <= 1e-9 and any(b.prefix is not None for b in sl.batches)


def test_cut_with_lora(tiny64):
    pytest.importorskip("peft", reason="LoRA needs the peft package (pip install -e '.[lora]')")
    from tsrl_cli.policy import wrap_lora

    model = wrap_lora(copy.deepcopy(tiny64), 4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=0)
    with torch.no_grad():  # B starts at 0: move it so the adapters shape the prompt's keys and values
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ro = shared_prompt_groups(seed=2)
    obj = Objective("grpo", LossConfig())
    ref = grads(model, lazy_loss(model, ro, obj))
    sl, g = run(model, ro, obj, order_seed=1)
    assert rel(g, ref) <= 1e-9 and any(b.prefix is not None for b in sl.batches)


def test_cut_stays_off_where_it_does_not_apply(tiny64, teacher64):
    ro = shared_prompt_groups()
    kl = Objective("grpo", LossConfig(kl_coef=0.1))
    assert StreamLearner(tiny64, kl, {}, prefix_cut=True, ref_model=teacher64).cut is None  # a reference model
    assert StreamLearner(tiny64, kl, {}, prefix_cut=True).cut is not None
    sl, _ = run(tiny64, ro, Objective("grpo", LossConfig()), cut=False)
    assert sl.cut is None and all(b.prefix is None for b in sl.batches)


@pytest.mark.parametrize("loss", [{}, {"loss_agg": "seq-mean-token-mean"}, {"kl_coef": 0.05}])
@pytest.mark.parametrize("unit", ["turn", "trajectory", "sync"])
def test_opd_cut_equals_the_lazy_batch(tiny64, teacher64, loss, unit):
    """OPD: the samples of one prompt share its prompt part; turns arrive scored, trajectories interleaved."""
    ro = opd_round(teacher64, ref=teacher64)
    obj = Objective("opd", LossConfig(**loss))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in ro), prefix_cut=True,
                       opd_unit="trajectory" if unit == "sync" else unit)
    if unit == "sync":
        for r in ro:
            sl.on_opd_trajectory(r)
        sl.drain()
        g = sl.close_round()
    else:  # round-robin over trajectories, one scored turn at a time, a step after each
        g = stream_turns(sl, ro)
    assert rel(g, ref) <= 1e-9
    assert sum(b.prompt for b in sl.batches) == sum(12 + g - 1 for g in range(3))  # one prompt part per group
    assert any(b.prefix is not None and b.target[0] == "unit" for b in sl.batches) == (
        unit == "turn" and loss.get("loss_agg") == "seq-mean-token-mean")  # unit buffers carried adjoints


def test_opd_unit_scale_weights_its_adjoint(tiny64, teacher64, monkeypatch):
    """The control of the OPD case: a unit's prompt adjoint taken with scale 1 instead of 1/n_i is caught."""
    ro = opd_round(teacher64)
    obj = Objective("opd", LossConfig(loss_agg="seq-mean-token-mean"))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    real = PromptState.adjoint
    monkeypatch.setattr(PromptState, "adjoint", lambda self, adv, unit=None: real(self, adv, lambda key: 1.0))
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in ro), prefix_cut=True, opd_unit="turn")
    assert rel(stream_turns(sl, ro), ref) > 1e-3


@pytest.mark.parametrize("loss", [{}, {"loss_agg": "seq-mean-token-mean"}, {"kl_coef": 0.05, "loss_agg": "token-mean"}])
@pytest.mark.parametrize("cut", [True, False])
@pytest.mark.parametrize("burst", [1, 2])
def test_opd_segments_equal_the_lazy_batch(tiny64, teacher64, loss, cut, burst):
    """OPD unit `segment` (rl/prefix.py Chain): each turn forwarded once over its segment, backwarded for its own loss,
    its dependence on earlier segments replayed at the trajectory's end; with and without the group's prompt part,
    one or two queued turns per row."""
    ro = opd_round(teacher64, ref=teacher64)
    obj = Objective("opd", LossConfig(**loss))
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in ro), prefix_cut=cut, opd_unit="segment")
    assert rel(stream_turns(sl, ro, burst), ref) <= 1e-9
    real = sum(b.real_tokens for b in sl.batches)
    own = sum(max(j for j, m in enumerate(r.loss_mask) if m) + 1 for r in ro)
    rows = Counter(b.items[0].rollout.key for b in sl.batches)
    # every position forwarded once (the prompt parts, then each trajectory's segments), and the one position a row
    # re-encodes for the next: its logits score the next row's first token
    prompt = {f"g{g}": 12 + g - 1 for g in range(3)} if cut else {}
    shared = sum(prompt.get(r.group_id, 0) for r in ro if (r.group_id, r.sample_index) != ("g0", 4))  # odd: whole
    assert real == own - shared + sum(prompt.values()) + sum(n - 1 for n in rows.values())
    assert sl.chains == {} and (sl.cut is None or sl.cut.states == {})


def test_dropping_a_segments_replay_is_caught(tiny64, teacher64, monkeypatch):
    from tsrl_cli.rl.prefix import Chain

    ro = opd_round(teacher64)
    obj = Objective("opd", LossConfig())
    ref = grads(tiny64, lazy_loss(tiny64, ro, obj))
    monkeypatch.setattr(Chain, "replay", lambda self, *a: [])
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in ro), prefix_cut=False, opd_unit="segment")
    assert rel(stream_turns(sl, ro), ref) > 1e-3
