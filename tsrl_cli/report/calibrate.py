"""Prediction from one trace: fit the event model's machine terms on paired runs, judge it on others.

A sync run's trace lacks three things stream's step time depends on (predict.Calibration): what a
stream backward costs per position against the sync batch (smaller matrices, a prefix per OPD turn),
a fixed cost per backward, and how much the rollout side slows while the learner computes (shared
cores). Each is fitted, per objective, on paired rounds: round k of a sync run and round k of the
stream run of the same experiment and seed (the same tasks, latency draws and, up to summation order,
weights). A row is predicted from the sync round alone and compared with the stream round's measured
step time.

Held-out: leave one group out (`by` = seed or experiment); every row is predicted by a calibration
fitted on the other groups only, so the reported error is out of sample.

The fit minimises the mean absolute % error by Nelder-Mead from the identity calibration, within
bounds, restarted from its best point: three parameters, a few hundred rows, pure python.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_atomic, write_json_atomic
from tsrl_cli.predict import Calibration, calibrated_drain
from tsrl_cli.report.load import config_value, load_results
from tsrl_cli.report.plots import prediction_residuals
from tsrl_cli.traces import RoundTrace, load_trace

CALIBRATION_FORMAT = "tsrl-calibration-1"
BOUNDS = {"cost_scale": (0.05, 20.0), "per_backward_s": (0.0, 10.0), "rollout_slowdown": (0.0, 10.0)}
STARTS = ()  # further starting points besides `start` (the identity); each triples the fit's time
TOL_PCT = 0.002  # the fit stops when the mean |error| moves by less than this many percentage points
STEPS = {"cost_scale": 0.5, "per_backward_s": 0.01, "rollout_slowdown": 0.5}  # the first simplex's edges


@dataclass(frozen=True)
class PairedRound:
    experiment: str
    seed: int
    objective: str
    round: int
    spread: float | None  # the runs' spread key (rollout.tool_latency_sigma by default)
    sync: RoundTrace  # the sync run's round: what the prediction may use
    measured_stream_s: float  # the stream run's step time of the same round

    @property
    def balance(self) -> float | None:
        """Learner work over rollout makespan of the sync round (W / M): the batch over the last arrival."""
        m = max((i.finished_at_s for i in self.sync.items), default=0.0)
        return (self.sync.batch_work_s or 0.0) / m if m > 0 else None


def paired_rounds(roots: list[str | Path], warmup: int = 4, spread_key: str = "rollout.tool_latency_sigma"
                  ) -> list[PairedRound]:
    """Every round after the warm-up that both a sync and a stream run of one (experiment, seed) have."""
    runs = []
    for root in roots:
        if not Path(root).is_dir():
            raise UsageError(f"{root}: not a folder (a results tree of <experiment>/<schedule>/seed<k>/ runs)")
        runs += load_results(root).runs
    by = {(r.experiment, r.seed, r.schedule): r for r in runs}
    rows = []
    for (exp, seed, sched), run in sorted(by.items()):
        other = by.get((exp, seed, "stream"))
        if sched != "sync" or other is None:
            continue
        sync, stream = load_trace(run.path), load_trace(other.path)
        measured = {r.round: r.measured_step_s for r in stream.rounds if r.measured_step_s}
        objective = str(run.config.get("objective", "grpo"))
        spread = config_value(run.config, spread_key)
        for r in sync.rounds:
            if r.round > warmup and r.round in measured and r.batch_work_s:
                rows.append(PairedRound(exp, seed, objective, r.round,
                                        float(spread) if spread is not None else None, r, measured[r.round]))
    if not rows:
        raise UsageError(f"{', '.join(map(str, roots))}: no paired sync/stream rounds after round {warmup} "
                         "(run `tsrl sweep ... --schedules sync,stream` first)")
    return rows


def predict_stream_s(row: PairedRound, cal: Calibration) -> float:
    """Stream's step time of the row's round, from its sync round and the calibration."""
    r = row.sync
    return calibrated_drain(r.items, r.learners or 1, r.batch_work_s, r.batch_positions, cal) \
        + (r.step_s or 0.0) + (r.sync_s or 0.0)


def error_pct(row: PairedRound, cal: Calibration) -> float:
    return 100.0 * (predict_stream_s(row, cal) - row.measured_stream_s) / row.measured_stream_s


def mean_abs_error(rows: list[PairedRound], cal: Calibration) -> float:
    return statistics.fmean(abs(error_pct(r, cal)) for r in rows)


def fit(rows: list[PairedRound], start: Calibration = Calibration(), max_evals: int = 800) -> Calibration:
    """The calibration with the least mean |error| on rows: Nelder-Mead within BOUNDS (clipped), restarted
    from its own best point until a restart no longer improves it (the error is not smooth in the terms)."""
    if not rows:
        raise UsageError("nothing to fit: no paired rounds")
    keys = list(BOUNDS)

    def clip(x: list[float]) -> list[float]:
        return [min(BOUNDS[k][1], max(BOUNDS[k][0], v)) for k, v in zip(keys, x, strict=True)]

    def err(x: list[float]) -> float:
        return mean_abs_error(rows, Calibration(*x))

    found = []
    for x0 in (start, *STARTS):  # several starts: the error surface has local minima
        best = clip([getattr(x0, k) for k in keys])
        best_err, evals = err(best), 1
        while evals < max_evals:
            x, e, used = _nelder_mead(err, clip, best, [STEPS[k] for k in keys], max_evals - evals)
            evals += used
            if e >= best_err - TOL_PCT:  # a restart from the best point found nothing better
                break
            best, best_err = x, e
        found.append((best_err, best))
    return Calibration(*min(found)[1])


def _nelder_mead(f, clip, x0: list[float], steps: list[float], budget: int) -> tuple[list[float], float, int]:
    """Minimise f from x0 (standard coefficients: reflect 1, expand 2, contract 1/2, shrink 1/2)."""
    n = len(x0)
    simplex = [x0] + [clip([v + (steps[i] if i == j else 0.0) for j, v in enumerate(x0)]) for i in range(n)]
    vals = [f(x) for x in simplex]
    used = n + 1
    while used < budget:
        order = sorted(range(n + 1), key=vals.__getitem__)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < TOL_PCT:  # the simplex's errors agree to TOL_PCT percentage points
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        def toward(t: float, centroid: list[float] = centroid, worst: list[float] = simplex[-1]) -> list[float]:
            return clip([c + t * (w - c) for c, w in zip(centroid, worst, strict=True)])

        xr = toward(-1.0)
        fr = f(xr)
        used += 1
        if fr < vals[0]:
            xe = toward(-2.0)
            fe = f(xe)
            used += 1
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = toward(0.5)
            fc = f(xc)
            used += 1
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [clip([b + 0.5 * (v - b) for b, v in zip(simplex[0], x, strict=True)])
                                          for x in simplex[1:]]
                vals = [vals[0]] + [f(x) for x in simplex[1:]]
                used += n
    i = min(range(n + 1), key=vals.__getitem__)
    return simplex[i], vals[i], used


def heldout(rows: list[PairedRound], by: str = "seed", progress: Callable[[str], None] = lambda m: None
            ) -> list[dict]:
    """Each row predicted by the calibration fitted on the other `by` groups of its objective."""
    if by not in ("seed", "experiment"):
        raise UsageError(f"--heldout-by {by}: one of seed, experiment")
    out = []
    for obj in sorted({r.objective for r in rows}):
        mine = [r for r in rows if r.objective == obj]
        groups = sorted({getattr(r, by) for r in mine})
        if len(groups) < 2:
            raise UsageError(f"{obj}: one {by} only ({groups[0]}); held-out needs at least two")
        for g in groups:
            cal = fit([r for r in mine if getattr(r, by) != g])
            progress(f"{obj}: fitted without {by} {g}: {cal}")
            for r in (r for r in mine if getattr(r, by) == g):
                out.append(_row(r, cal, held_out=f"{by}={g}"))
    return out


def _row(r: PairedRound, cal: Calibration, held_out: str) -> dict:
    pred = predict_stream_s(r, cal)
    return {"objective": r.objective, "experiment": r.experiment, "seed": r.seed, "round": r.round,
            "spread": r.spread, "balance": r.balance, "measured_stream_s": r.measured_stream_s,
            "predicted_stream_s": pred, "error_pct": 100.0 * (pred - r.measured_stream_s) / r.measured_stream_s,
            "identity_error_pct": error_pct(r, Calibration()), "held_out": held_out, **asdict(cal)}


def summary(rows: list[dict]) -> dict:
    """Mean |error| per objective and overall, the calibrated model's and the identity's (no calibration)."""
    out = {}
    for obj in [*sorted({r["objective"] for r in rows}), "all"]:
        rs = [r for r in rows if obj in ("all", r["objective"])]
        errs = sorted(abs(r["error_pct"]) for r in rs)
        out[obj] = {"rows": len(rs), "mean_abs_error_pct": statistics.fmean(errs),
                    "median_abs_error_pct": statistics.median(errs),
                    "p90_abs_error_pct": errs[int(0.9 * (len(errs) - 1))],
                    "mean_error_pct": statistics.fmean(r["error_pct"] for r in rs),
                    "identity_mean_abs_error_pct": statistics.fmean(abs(r["identity_error_pct"]) for r in rs)}
    return out


def calibrate(roots: list[str | Path], out: str | Path, *, warmup: int = 4, heldout_by: str | None = "seed",
              spread_key: str = "rollout.tool_latency_sigma", progress: Callable[[str], None] = lambda m: None
              ) -> dict:
    """Fit per objective on every paired round (calibration.json), and, with heldout_by, judge the
    method out of sample (heldout_rows.csv, heldout.md, residuals.png). Returns the summary document."""
    if heldout_by not in (None, "seed", "experiment"):  # checked before any work or any file
        raise UsageError(f"--heldout-by {heldout_by}: one of seed, experiment, none")
    rows = paired_rounds(roots, warmup, spread_key)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    cals = {}
    for obj in sorted({r.objective for r in rows}):
        mine = [r for r in rows if r.objective == obj]
        cal = fit(mine)
        cals[obj] = {**asdict(cal), "rows": len(mine), "fit_mean_abs_error_pct": mean_abs_error(mine, cal),
                     "experiments": sorted({r.experiment for r in mine}), "seeds": sorted({r.seed for r in mine})}
        progress(f"{obj}: {len(mine)} paired rounds, fitted {cal}")
    doc = {"format": CALIBRATION_FORMAT, "warmup": warmup, "sources": [str(r) for r in roots], "objectives": cals}
    write_json_atomic(folder / "calibration.json", doc)
    res = {"out": str(folder), "calibration": doc, "heldout": None}
    if heldout_by:
        hrows = heldout(rows, heldout_by, progress)
        res["heldout"] = {"by": heldout_by, "summary": summary(hrows)}
        write_atomic(folder / "heldout_rows.csv", _csv(hrows))
        write_atomic(folder / "heldout.md", _markdown(res["heldout"], spread_key))
        _residual_figure(folder / "residuals.png", hrows, spread_key)
    return res


def load_calibration(path: str | Path, objective: str) -> Calibration:
    """The objective's calibration from a calibration.json written by `tsrl calibrate`."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"--calibration {p}: not found (write one with `tsrl calibrate RUNS --out DIR`)") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--calibration {p}: not JSON ({e.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != CALIBRATION_FORMAT:
        raise UsageError(f"--calibration {p}: not a {CALIBRATION_FORMAT} file (write one with `tsrl calibrate`)")
    got = doc.get("objectives", {}).get(objective)
    if got is None:
        raise UsageError(f"--calibration {p}: no {objective} calibration (it has "
                         f"{', '.join(doc.get('objectives', {})) or 'none'}); fit one on {objective} runs")
    return Calibration(**{k: float(got[k]) for k in BOUNDS})


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _markdown(h: dict, spread_key: str) -> str:
    lines = [f"# Stream's step time predicted from the sync trace alone (held out by {h['by']})", "",
             "Each row: a sync round predicts the same round of the stream run of that experiment and seed, with a "
             f"calibration fitted on the other {h['by']}s only. `identity`: the model without calibration.", "",
             "| objective | rows | mean abs error | median | p90 | mean (signed) | identity mean abs error |",
             "|---|---|---|---|---|---|---|"]
    for obj, s in h["summary"].items():
        lines.append(f"| {obj} | {s['rows']} | {s['mean_abs_error_pct']:.2f} % | {s['median_abs_error_pct']:.2f} % | "
                     f"{s['p90_abs_error_pct']:.2f} % | {s['mean_error_pct']:+.2f} % | "
                     f"{s['identity_mean_abs_error_pct']:.2f} % |")
    lines += ["", f"Residuals against balance (sync W/M) and spread (`{spread_key}`): residuals.png; every row: "
              "heldout_rows.csv.", ""]
    return "\n".join(lines)


def _residual_figure(path: Path, rows: list[dict], spread_key: str) -> None:
    from matplotlib.figure import Figure  # an Agg canvas, no pyplot

    fig = Figure(figsize=(9.0, 3.8), dpi=110, layout="constrained")
    prediction_residuals(rows, fig.subplots(1, 2, sharey=True), spread_key)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(path, buf.getvalue())
