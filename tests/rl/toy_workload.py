"""The toy workload's settings, shared by the fixtures and by tests that pass them on a command line."""

# Small and quick: 2 prompts x 4 samples per round, at most 3 turns of 32 tokens.
TOY = [
    "model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
    "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
    "rollout.max_trajectory_tokens=400", "optim.lr=1e-2",
]
