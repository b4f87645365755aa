"""OPD at long horizons: stream's learner compute against the lazy batch's, per OPD unit, at K turns.

One round of OPD on synthetic agent trajectories of K model turns each (a prompt, then K turns with a
tool observation after every turn but the last), float64, through the schedules `tsrl train` runs
(rl/schedules.learn_stream and learn_sync) on one CPU process, with a scripted message queue in
place of the rollout and teacher processes. The teacher's scores come from a second tiny model.

Arrivals: the turns of all trajectories interleave (every trajectory's turn 0, then every turn 1, ...),
each trajectory ends right after its last turn, and the learner finds one message queued each time it
looks (`--burst 1`: tools are slow, so a turn is backwarded before the next one arrives). That is the
case per-turn streaming is for, and the one where re-encoding costs most: with learner.opd_unit
`turn` every turn is a backward over its whole prefix. `--burst B` lets B messages queue (a busy
learner): a trajectory's queued turns then share one row.

Per K and unit, beside the lazy batch (`sync`: one padded batch after the last arrival):
  positions      token positions the backwards covered (RoundWork.work(): rows x width per backward)
  replayed       positions backwarded again without a forward: the unit `segment` (rl/prefix.py Chain, the
                 authors' per-turn scheme) replays each segment's kept graph at its trajectory's end
  / sum T_i      over every trajectory once; / B x T_max over the lazy padded batch
  cpu / lazy     learner CPU seconds inside the backwards (RoundWork.busy_cpu_s), median of --repeat
                 runs, over the lazy batch's (a padded batch on a CPU costs more than its rows alone:
                 docs/streaming.md, "Micro-batching")
  max_rel_diff   the streamed gradient against the verl-style lazy loss (rl.learner.lazy_loss), float64

    .venv/bin/python experiments/opd_horizon.py                     # K = 8, 16, 32; units turn, trajectory, segment
    .venv/bin/python experiments/opd_horizon.py --turns 8 --loss-agg seq-mean-token-mean --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter

import torch

from tsrl_cli.config import OPD_UNITS, LossConfig
from tsrl_cli.core.graddiff import compare
from tsrl_cli.policy import build_tiny_model, score_tokens
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rl.prefix import SEGMENT
from tsrl_cli.rl.schedules import learn_stream, learn_sync
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnScored
from tsrl_cli.rollouts import Rollout

VOCAB = 128


def horizon_round(turns: int, trajectories: int = 8, seed: int = 0, prompt: int = 32,
                  turn_tokens: tuple[int, int] = (8, 24), obs_tokens: tuple[int, int] = (8, 40)) -> list[Rollout]:
    """`trajectories` rollouts of `turns` model turns each (two groups), random tokens and lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(trajectories):
        ids = [rng.randrange(VOCAB) for _ in range(prompt)]
        mask, spans = [0] * prompt, []
        for k in range(turns):
            s = len(ids)
            n = rng.randint(*turn_tokens)
            ids += [rng.randrange(VOCAB) for _ in range(n)]
            mask += [1] * n
            spans.append((s, len(ids)))
            if k < turns - 1:
                o = rng.randint(*obs_tokens)
                ids += [rng.randrange(VOCAB) for _ in range(o)]
                mask += [0] * o
        out.append(Rollout(f"g{i % 2}", i // 2, ids, mask, 0.0, spans))
    return out


def scored(rollouts: list[Rollout], teacher) -> list[Rollout]:
    for r in rollouts:
        r.teacher_logprobs = score_tokens(teacher, r.input_ids)
    return rollouts


def messages(rollouts: list[Rollout]) -> list:
    """The round as the learner receives it: turns interleaved across trajectories, each trajectory's end
    right after its last turn (a trajectory's turns always come before its end, as the teacher sends them)."""
    out, t = [], 0.0
    for k in range(max(len(r.turn_spans) for r in rollouts)):
        for r in rollouts:
            if k < len(r.turn_spans):
                t += 1.0
                e = r.turn_spans[k][1]
                partial = Rollout(r.group_id, r.sample_index, r.input_ids[:e], r.loss_mask[:e], 0.0,
                                  list(r.turn_spans[:k + 1]) + [(e, e)], teacher_logprobs=r.teacher_logprobs[:e])
                out.append(TurnScored(1, 0, partial, k, closed_at=t - 0.5, finished_at=t, teacher_start=t - 0.2))
                if k == len(r.turn_spans) - 1:
                    out.append(TrajectoryDone(1, 0, r, "t", "submitted", len(r.turn_spans), finished_at=t))
    return out


class ScriptedLearner:
    """What the schedules use of rl.learner_worker.Learner on one CPU process (learner.microbatch auto: one row
    per backward, a trajectory's queued turns in one row), fed from a list: `burst` messages per look."""

    def __init__(self, model, obj: Objective, msgs: list, burst: int, opd_unit: str):
        self.model, self.obj, self.opd_unit = model, obj, opd_unit
        self.msgs, self.burst = list(msgs), burst
        self.version, self.coalesce_turns = 0, True

        class Cfg:
            sync_batching = "padded"

        self.cfg = Cfg()

    @property
    def sync_batching(self) -> str:  # rl.schedules.ScheduleHost: sync's batching after the last arrival
        return self.cfg.sync_batching

    def round_learner(self, plan: RoundPlan, token_weights=None, max_items=1) -> StreamLearner:
        self.last = StreamLearner(self.model, self.obj, plan.group_sizes(), max_items=max_items,
                                  token_weights=token_weights, opd_unit=self.opd_unit)
        return self.last

    def receive(self, plan, block, limit=None):
        n = self.burst if limit is None else min(limit, self.burst)
        taken, self.msgs = self.msgs[:n], self.msgs[n:]
        if block and not taken:
            raise RuntimeError("the learner waits for a message the round never sends")
        return taken

    def progress(self, round_, work):
        pass

    def finish(self, sl, plan, work):
        return sl.close_round()


def plan_of(rollouts: list[Rollout]) -> RoundPlan:
    return RoundPlan(1, tuple(GroupSpec(g, "t", n) for g, n in Counter(r.group_id for r in rollouts).items()))


def run_round(model, rollouts: list[Rollout], obj: Objective, schedule: str, unit: str = "trajectory",
              burst: int = 1):
    """One round under `stream` (with learner.opd_unit `unit`) or `sync` (the lazy padded batch): its RoundWork."""
    learner = ScriptedLearner(model, obj, messages(rollouts), burst, unit)
    work = (learn_stream if schedule == "stream" else learn_sync)(learner, plan_of(rollouts))
    work.replayed = learner.last.replayed
    return work


def measure(turns: int, *, trajectories: int = 8, loss_agg: str = "token-mean", burst: int = 1, repeat: int = 3,
            seed: int = 0, hidden: int = 64, layers: int = 2, units=(*OPD_UNITS, SEGMENT)) -> dict:
    """The table's rows for one K: the lazy batch, then stream per unit."""
    width = 32 + turns * 64 + 64
    model = build_tiny_model(seed, torch.float64, vocab_size=VOCAB, hidden=hidden, layers=layers, max_positions=width)
    teacher = build_tiny_model(seed + 1000, torch.float64, vocab_size=VOCAB, hidden=hidden, layers=layers,
                               max_positions=width)
    ro = scored(horizon_round(turns, trajectories, seed), teacher)
    obj = Objective("opd", LossConfig(loss_agg=loss_agg))
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ref = list(torch.autograd.grad(lazy_loss(model, ro, obj), params))
    cases = [("sync", "-")] + [("stream", u) for u in units]
    cpu: dict = {c: [] for c in cases}
    works: dict = {}
    for _ in range(repeat):  # interleaved, so that a load change on the machine hits every case alike
        for sched, unit in cases:
            w = run_round(model, ro, obj, sched, unit if unit != "-" else "turn", burst)
            cpu[(sched, unit)].append(w.busy_cpu_s)
            works[(sched, unit)] = w
    lazy = works[("sync", "-")].work()
    lazy_cpu = statistics.median(cpu[("sync", "-")])
    rows = []
    for sched, unit in cases:
        w = works[(sched, unit)]
        wk = w.work()
        c = statistics.median(cpu[(sched, unit)])
        rows.append({
            "turns": turns, "schedule": sched, "opd_unit": None if unit == "-" else unit,
            "positions": wk["positions"], "replayed": w.replayed, "trajectory_tokens": wk["trajectory_tokens"],
            "padded_tokens": wk["padded_tokens"], "backwards": w.backwards,
            "positions_over_sum_T": wk["positions"] / wk["trajectory_tokens"],
            "positions_over_lazy_batch": wk["positions"] / lazy["positions"],
            "cpu_s": c, "cpu_over_lazy": c / lazy_cpu if lazy_cpu > 0 else None,
            "max_rel_diff": compare(names, ref, w.grads)["max_rel_diff"],
        })
    return {"turns": turns, "trajectories": trajectories, "loss_agg": loss_agg, "burst": burst, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32], help="model turns per trajectory (K)")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--loss-agg", default="token-mean")
    ap.add_argument("--burst", type=int, default=1, help="messages queued each time the learner looks")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; CPU seconds are their median")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = [measure(k, trajectories=a.trajectories, loss_agg=a.loss_agg, burst=a.burst, repeat=a.repeat,
                   seed=a.seed, hidden=a.hidden, layers=a.layers) for k in a.turns]
    if a.json:
        print(json.dumps({"results": out, "wall_s": time.perf_counter() - t0}))
        return 0
    print(f"OPD, {a.trajectories} trajectories, {a.loss_agg}, float64, tiny Qwen3 h{a.hidden}/l{a.layers}, "
          f"burst {a.burst}, CPU seconds median of {a.repeat}")
    print(f"{'K':>3} {'schedule':<9} {'unit':<10} {'positions':>9} {'replayed':>8} {'/sum T_i':>8} {'/lazy':>6} "
          f"{'backwards':>9} {'cpu s':>7} {'cpu/lazy':>8} {'rel diff':>9}")
    for res in out:
        for r in res["rows"]:
            print(f"{r['turns']:>3} {r['schedule']:<9} {r['opd_unit'] or '-':<10} {r['positions']:>9} "
                  f"{r['replayed']:>8} "
                  f"{r['positions_over_sum_T']:>8.3f} {r['positions_over_lazy_batch']:>6.3f} {r['backwards']:>9} "
                  f"{r['cpu_s']:>7.3f} {r['cpu_over_lazy']:>8.3f} {r['max_rel_diff']:>9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
