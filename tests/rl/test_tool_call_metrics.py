"""Each round's tool_call_errors in metrics.jsonl equals a recount from the round's saved rollouts.

The reference is independent of the agent loop's counter: every saved model turn (rollouts.jsonl, its
turn_spans) is parsed again with the run's renderer. At temperature 5 the toy policy writes mostly noise,
so errors occur; a round without any would make the comparison 0 == 0, so the test asks for some.
"""

import json
from collections import Counter

from tsrl_cli.agent.template import make_renderer
from tsrl_cli.policy import load_tokenizer
from tsrl_cli.rl.train import train


def test_round_metrics_count_the_turns_whose_call_could_not_run(toy_config, toy_policies):
    cfg = toy_config("rollout.temperature=5.0", out="noisy", rounds=1, schedule="sync", **{"run.save_rollouts": True})
    train(cfg)
    row = json.loads((cfg.run_dir() / "metrics.jsonl").read_text().splitlines()[0])
    renderer = make_renderer(load_tokenizer(toy_policies[0]), cfg.model.chat_template, cfg.rollout.thinking)
    kinds = Counter()
    for line in (cfg.run_dir() / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        for s, e in r["turn_spans"]:
            action = renderer.parse(r["input_ids"][s:e])
            kinds[action.error] += action.kind == "format_error"
    kinds = +kinds  # drop the zero counts
    assert row["tool_call_errors"] == sum(kinds.values()) > 0
    assert row["tool_call_error_kinds"] == dict(kinds)
