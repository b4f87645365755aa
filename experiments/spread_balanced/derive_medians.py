"""Print the lognormal medians of the spread-at-fixed-balance family (experiments/spread_balanced/).

For each sigma, the median m is chosen so that the expected round makespan of injected tool latency,
E[max over the round's trajectories of the sum of its calls' delays], equals sigma 0's, where every call
takes the family's base latency. Learner work per round does not depend on sigma, so holding the
expected makespan fixed holds the balance (learner work / makespan) near sigma 0's.
    .venv/bin/python experiments/spread_balanced/derive_medians.py
"""

from tsrl_cli.agent.latency import balanced_median_s

SIGMAS = (0.0, 0.5, 1.0, 1.5)
# Seconds per tool call at sigma 0, set so that learner busy / makespan under sync is near 1 at sigma 0
# (pilot, results/LOG.md 2026-12-03: GRPO 1.13 at 0.45 s, OPD 0.82 at 0.13 s, on a lightly loaded CPU).
BASE_S = {"grpo": 0.5, "opd": 0.10}
# Tool calls of the 32 trajectories per round (4 prompts x 8, max_turns 4): in the pilot's 10-round runs
# about 12 (GRPO) and 7 (OPD) of 32 ran to max_turns per round; the rest submitted after about 2 calls.
CALLS_N = {"grpo": [4] * 12 + [2] * 20, "opd": [4] * 8 + [2] * 24}
# Seconds added to the target tool makespan: the generation part of GRPO's makespan shrank with sigma in
# the pilot (seed 43, rounds 3-10, sync: M 2.89 s at sigma 0, 2.37 s at 1.0, 2.51 s at 1.5, against a
# tool makespan fixed in expectation). The trajectories desynchronize, so the last one's turns generate in
# smaller batches. Offset = the measured shortfall less the short-window Monte Carlo bias (the mean of 8
# rounds' max is 0.04 s / 0.12 s below its expectation at sigma 1.0 / 1.5). OPD's makespan did not move.
EXTRA_S = {"grpo": {1.0: 0.48, 1.5: 0.26}, "opd": {}}

if __name__ == "__main__":
    print("objective  sigma  median_s  mean_per_call_s")
    for objective, base in BASE_S.items():
        for sigma in SIGMAS:
            m = balanced_median_s(base, sigma, CALLS_N[objective], EXTRA_S[objective].get(sigma, 0.0))
            print(f"{objective:9s}  {sigma:5.1f}  {m:8.4f}  {m * 2.718281828459045 ** (sigma**2 / 2):15.4f}")
