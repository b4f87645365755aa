"""The embedded default: a task suite built locally (no hub, no Docker) and the recipe of its tiny policy.

  repair_suite.py, terminal_suite.py   the task generators (each task validated by running it)
  prepare.py                           `tsrl prepare-data embedded`: the suite, prepared like any source
  policy/                              the default student and teacher: demonstrations, copy curriculum, build
"""
