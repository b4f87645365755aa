"""Held-out success before and after RL, per seed, with the margin and the seed-to-seed spread.

Reads the runs of `tsrl sweep recipes/embedded_policy/heldout/*.yaml --out results/heldout_v4` (each run's
eval_round0.json and its last metrics row with eval/ keys) and prints one JSON document:
per experiment, per seed: success at round 0 and at the last evaluated round, and their gain;
then the mean gain (the margin), the spread of the final success over seeds (max - min), the
spread of the gain, and whether the margin exceeds both spreads.

  .venv/bin/python recipes/embedded_policy/heldout/summarize.py results/heldout_v4 [--curves curves.csv]

--curves also writes the training curves, one row per experiment, seed and round: reward_mean (the
round's training reward), the trajectories that ended at max_turns, and mean turns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    args = sys.argv[1:]
    curves = args.pop(args.index("--curves") + 1) if "--curves" in args else None
    args = [a for a in args if a != "--curves"]
    root = Path(args[0] if args else "results/heldout")
    out, curve_rows = {}, []
    for exp in sorted(p for p in root.iterdir() if p.is_dir()):
        seeds = {}
        for run in sorted(exp.glob("*/seed*")):
            r0 = run / "eval_round0.json"
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
                if (run / "metrics.jsonl").is_file() else []
            last = [r for r in rows if any(k.startswith("eval/") and k.endswith("/success") for k in r)]
            if not r0.is_file() or not last:
                continue
            curve_rows += [f"{exp.name},{run.name},{r['round']},{r['reward_mean']},"
                           f"{r.get('exit_reasons', {}).get('max_turns', 0)},{r['turns_mean']}" for r in rows]
            m0, m1 = json.loads(r0.read_text()), last[-1]
            for key in (k for k in m0 if k.endswith("/success")):
                seeds.setdefault(key, {})[run.name] = {
                    "round0": m0[key], "round": m1["round"], "final": m1[key], "gain": round(m1[key] - m0[key], 4),
                    "n": m1[key.replace("/success", "/n")],
                    "rewards_first_last5": [round(sum(r["reward_mean"] for r in rows[:5]) / 5, 3),
                                            round(sum(r["reward_mean"] for r in rows[-5:]) / 5, 3)]}
        for key, per in seeds.items():
            gains = [v["gain"] for v in per.values()]
            finals = [v["final"] for v in per.values()]
            margin = sum(gains) / len(gains)
            out[f"{exp.name}:{key}"] = {
                "seeds": per, "margin_mean_gain": round(margin, 4),
                "spread_final": round(max(finals) - min(finals), 4), "spread_gain": round(max(gains) - min(gains), 4),
                # a spread needs two seeds at least: with one, no verdict (null)
                "margin_exceeds_spreads": None if len(per) < 2 else
                (margin > max(finals) - min(finals) and margin > max(gains) - min(gains))}
    if curves:
        Path(curves).write_text("experiment,seed,round,reward_mean,max_turns_exits,turns_mean\n"
                                + "".join(x + "\n" for x in curve_rows))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
