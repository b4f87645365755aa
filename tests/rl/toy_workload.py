"""The toy workload's settings, shared by the fixtures and by tests that pass them on a command line."""

# Small and quick: 2 prompts x 4 samples per round, at most 3 turns of 32 tokens. lr 1e-3: at 1e-2 the toy
# student scores 0 in every GRPO group from round 2 on (reward_std 0, a zero gradient), so a comparison of later
# rounds' weights would hold whatever those rounds did; at 1e-3 every round of 3 has a gradient (tests check it).
TOY = [
    "model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
    "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
    "rollout.max_trajectory_tokens=400", "optim.lr=1e-3",
]
