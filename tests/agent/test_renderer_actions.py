"""Renderer masks and spans on a hand-checked example; the action format."""

from tsrl_cli.agent.actions import parse_action, submitted_by_output
from tsrl_cli.agent.renderer import ChatMLRenderer, TokenTrajectory
from tsrl_cli.rollouts import parse_rollout


def test_hand_checked_trajectory(tok):
    r = ChatMLRenderer(tok)
    t = TokenTrajectory()
    p = r.prompt("sys", "task")
    t.append(p, 0)
    turn = r.encode("```bash\nls\n```") + [r.im_end]  # as sampled: the stop token is part of the turn
    span = t.append(turn, 1, [-0.5] * len(turn))
    t.turn_spans.append(span)
    obs = r.observation("[exit code 0]\na.py")
    t.append(obs, 0)
    turn2 = r.encode("```bash\nsubmit\n```") + [r.im_end]
    t.turn_spans.append(t.append(turn2, 1, [-0.1] * len(turn2)))

    text = tok.decode(t.input_ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\ntask<|im_end|>\n<|im_start|>assistant\n"
        "```bash\nls\n```<|im_end|>\n<|im_start|>user\n[exit code 0]\na.py<|im_end|>\n<|im_start|>assistant\n"
        "```bash\nsubmit\n```<|im_end|>"
    )
    assert t.turn_spans == [(len(p), len(p) + len(turn)), (len(p) + len(turn) + len(obs), len(t.input_ids))]
    masked = [tok.decode([i], skip_special_tokens=False) for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m]
    assert "".join(masked) == "```bash\nls\n```<|im_end|>```bash\nsubmit\n```<|im_end|>"
    assert t.behavior_logprobs[len(p)] == -0.5 and t.behavior_logprobs[0] == 0.0
    # the record validates against the core schema
    parse_rollout({"group_id": "g", "sample_index": 0, "input_ids": t.input_ids, "loss_mask": t.loss_mask,
                   "reward": 1.0, "turn_spans": [list(s) for s in t.turn_spans],
                   "behavior_logprobs": t.behavior_logprobs}, "test")


def test_prompt_matches_the_chat_template(tok):
    r = ChatMLRenderer(tok)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.prompt("S", "U") == tok.encode(text, add_special_tokens=False)


def test_actions():
    assert parse_action("THOUGHT: x\n```bash\nls -la\n```").command == "ls -la"
    assert parse_action("```bash\nsubmit\n```").kind == "submit"
    assert parse_action("no block").kind == "format_error"
    assert parse_action("```bash\nls\n```\n```bash\npwd\n```").kind == "format_error"
    assert parse_action("```bash\n\n```").kind == "format_error"
    assert submitted_by_output("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a b")
    assert not submitted_by_output("hello\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
