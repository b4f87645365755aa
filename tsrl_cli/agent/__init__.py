"""The multi-turn agent: ChatML rendering (token in, token out), actions, and the loop."""
