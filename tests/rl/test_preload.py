"""The forkserver's preload (rl/train.py PRELOAD) asks nothing of CUDA: every worker of a run forks from that
server, and a server that had initialised CUDA would leave each worker failing with "Cannot re-initialize CUDA in
forked subprocess". Each module is imported in a fresh interpreter with torch.cuda's query functions made to raise;
the control is a module that asks torch.cuda.is_available() when imported, which the same interpreter refuses."""

import subprocess
import sys
from pathlib import Path

import pytest

from tsrl_cli.rl.train import PRELOAD

ROOT = Path(__file__).resolve().parents[2]
QUERIES = ("is_available", "device_count", "init", "get_device_properties", "current_device", "_lazy_init")
# torch first (to patch it), then every module named, in order; set in torch.cuda's namespace, so torch's own
# functions that reach these through their module (memory queries call _lazy_init) raise too
IMPORTER = f"""
import importlib
import sys

import torch

def refuse(name):
    def query(*args, **kwargs):
        raise RuntimeError(f"torch.cuda.{{name}} called while importing the forkserver's preload")
    return query

for name in {QUERIES!r}:
    setattr(torch.cuda, name, refuse(name))
for module in sys.argv[1:]:
    importlib.import_module(module)
print("imported", *sys.argv[1:])
"""


def import_without_cuda(modules, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    path = str(ROOT) if extra_path is None else f"{extra_path}:{ROOT}"
    return subprocess.run([sys.executable, "-c", IMPORTER, *modules], capture_output=True, text=True, timeout=200,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
                          check=False)


@pytest.mark.timeout(240)  # two interpreters importing torch, transformers and the workers: about 10 s idle
def test_the_preload_imports_without_asking_cuda(tmp_path):
    (tmp_path / "asks_cuda.py").write_text("import torch\n\nHAS_CUDA = torch.cuda.is_available()\n")
    control = import_without_cuda(["asks_cuda"], tmp_path)  # the patch catches a module that asks
    assert control.returncode != 0 and "torch.cuda.is_available called while importing" in control.stderr
    res = import_without_cuda(PRELOAD)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["imported", *PRELOAD]
