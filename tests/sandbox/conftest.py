"""`isolation`: each test that takes it runs once per isolation this machine offers (bwrap; unshare as root)."""

import os
import shutil

import pytest

from tsrl_cli.sandbox import local as local_mod

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bwrap not installed (apt-get install bubblewrap)")
ISOLATIONS = [
    pytest.param("bwrap", marks=needs_bwrap),
    pytest.param("unshare", marks=pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                                     reason="unshare isolation needs root")),
]


@pytest.fixture(params=ISOLATIONS)
def isolation(request):
    if request.param == "bwrap" and not local_mod.bwrap_works():
        pytest.skip("bwrap is installed but cannot create namespaces here")
    return request.param
