"""Task data: public SWE and terminal task sets turned into one record format (`records.py`).

One module per source format (`swe_smith.py`, `swebench.py`, `harbor.py`), the loaders
(`sources.py`: hub or local path, the only place the two differ) and the pipeline
(`prepare.py`: normalize, filter, keep evaluation sets out of training, write, check).
Importing this package does not import pyarrow or datasets; the functions do.
"""
