"""The recipe of the shipped default policy (data/embedded_policy/): demonstrations, fine-tuning, build."""
