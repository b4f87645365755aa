"""The event model of one round: step time under sync, stream and async, from a trace.

A round is items (trajectories for GRPO, teacher-scored turns for OPD) reaching the learner at
`finished_at_s` (seconds since the round started), each needing `learner_cost_s` seconds of
learner work, then one optimizer step (`step_s`) and one weight sync (`sync_s`). With L learners:

  sync   = M + Wb/L + step + sync  lazy baseline: no backward starts before the last arrival M;
                                   the batch backward (Wb) splits evenly over L learners
  stream = D + step + sync         D: when the queue drains, each item starting at
                                   max(arrival, its learner free) on the first free learner, FIFO
  async  = max(R, Wb/L + step) + sync  one-step off-policy steady state: round k+1's rollout overlaps
                                   round k's learning; the weight sync blocks both sides. R is the
                                   rollout's own duration (a `rollout` event), which under async
                                   starts before the round does; M when the trace lacks it

Padding. The lazy baseline backwards one padded batch: B rows of the longest length T_max, so its
work Wb covers B * T_max token positions, while the per-item backwards of stream cover only each
item's own T_i (W = the sum of item costs). When items carry `tokens`, the model prices them so:
from a sync trace, item i costs Wb * T_i / (B * T_max) (the measured batch, shared out by real
tokens); from a stream trace, Wb = W * B * T_max / sum(T_i). Without token counts, Wb = W.
  speedup = sync / stream <= ceiling = (M + Wb/L + s) / (max(M, W/L) + s), s = step + sync,
  since D >= M and D >= W/L. With s = 0 the ceiling is 2 at balance (W/L == M), (M+W)/M when
  rollout dominates and (M+W)/W when learning does.

OPD: the unit of a backward (learner.opd_unit). Under `turn` the items are the teacher-scored turns, a
trajectory's queued turns sharing one backward over the latest turn's prefix; under `trajectory` each
trajectory is one item, arriving at its end with the cost of one row over its last turn's prefix. Both
units are also priced per token position (the trace's learner seconds / the positions its backwards
covered, `learner_work`): `opd_units` in each OPD round, `--opd-unit` to predict with the other one.
The teacher's scores set an OPD turn's arrival, so its load is reported beside (`teacher`, from the
`teacher` event): busy seconds against the rollout's, teacher-bound rounds (busier than the rollout
generated) and the positions its forwards covered per trajectory token.

Traces: a run directory (events.jsonl + metrics.jsonl, docs/run-directory.md), an events.jsonl,
or the minimal trace (CSV or JSONL rows with finished_at_s, learner_cost_s, optional round).
Pure python: no torch, no numpy.

  drain.py     stream's queue: drain_time over L learners, FIFO, OPD turns coalesced
  round.py     predict_round: one round's sync, stream and async step times; Calibration
  speedup.py   ratio and ceiling, the bound on sync / stream
  whatif.py    the what-if knobs (learner speed, tool speed, spread)
  opd.py       OPD: the unit of a backward, both units priced per position; the teacher's load
  trace.py     predict_rounds, predict_trace: every round of a trace and the summary after the warm-up
  gain.py      streaming_gain: what a run's streaming bought, for its summary
  granularity.py  stream per group (learner.granularity group) and the within-group arrival correlation

    tsrl predict --trace results/spread/stream/seed42 --json
    tsrl predict --trace trace.csv --step-s 0.5 --learners 2 --spread 2
"""

from tsrl_cli.predict.drain import _drain_many as _drain_many  # the general drain and its one-learner fast path,
from tsrl_cli.predict.drain import _drain_one as _drain_one  # which tests/test_predict.py checks agree
from tsrl_cli.predict.drain import drain_jobs, drain_time
from tsrl_cli.predict.gain import GAIN_KEYS, streaming_gain, streaming_of
from tsrl_cli.predict.granularity import arrival_icc, group_jobs
from tsrl_cli.predict.opd import opd_jobs, opd_trajectories, per_position_s, price_opd_units, recorded_unit
from tsrl_cli.predict.round import Calibration, calibrated_drain, padding_factor, predict_round
from tsrl_cli.predict.speedup import ceiling
from tsrl_cli.predict.trace import predict_rounds, predict_trace
from tsrl_cli.predict.whatif import what_if
from tsrl_cli.traces import Item, RoundTrace, Trace, load_trace

__all__ = ["GAIN_KEYS", "Calibration", "Item", "RoundTrace", "Trace", "arrival_icc", "calibrated_drain", "ceiling",
           "drain_jobs", "group_jobs",
           "drain_time", "load_trace", "opd_jobs", "opd_trajectories", "padding_factor", "per_position_s",
           "predict_round", "predict_rounds", "predict_trace", "price_opd_units", "recorded_unit", "streaming_gain",
           "streaming_of", "what_if"]
