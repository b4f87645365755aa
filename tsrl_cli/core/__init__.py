"""Pure math of gradient streaming: advantages, per-token losses, aggregation, accumulators.

Imports torch and the standard library only: no I/O, no config objects, no CLI.
"""
