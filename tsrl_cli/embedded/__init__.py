"""The embedded default: task suites and a tiny policy built locally, with no hub and no Docker."""
