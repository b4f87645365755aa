"""`tsrl report`: run directories -> tables, figures and REPORT.md (see build.py)."""
