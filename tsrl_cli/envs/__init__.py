"""Task environments for the agent loop: a sandbox per trajectory, tools, and the task's reward.

  repair.py    RepairTask (SWE-smith / SWE-bench / embedded): bash in the repository, reward from tests
"""
