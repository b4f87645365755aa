"""tsrl: exact gradient streaming for agentic RL (ThunderSyncRL reproduction).

Importing this package must stay cheap: no torch, no transformers (tests/test_imports.py).
"""

__version__ = "0.1.0"
