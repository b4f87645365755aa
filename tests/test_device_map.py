"""Logical devices (cuda:k, the k-th device this process sees) mapped through the inherited CUDA_VISIBLE_DEVICES
(devices.visible_devices, devices.physical_device): pure string logic, checked with the variable set to indices,
UUIDs, MIG ids and unset, without a GPU; and the weight bus's one-rank-per-GPU check comparing what they map to."""

import pytest

from tsrl_cli import devices
from tsrl_cli.config import load_config
from tsrl_cli.devices import CVD, physical_device, visible_devices
from tsrl_cli.errors import UsageError
from tsrl_cli.rl import weightbus
from tsrl_cli.rl.weightbus import bus_members, nccl_problem

UUIDS = "GPU-8c3e1f2a-0000-1111-2222-333344445555,GPU-1b2c3d4e-6666-7777-8888-999900001111"


@pytest.mark.parametrize("value,visible", [
    (None, None),  # unset: every GPU, cuda:k is GPU k
    ("2,3,6,7", ("2", "3", "6", "7")),
    (" 2, 03 ", ("2", "3")),  # spaces and leading zeros, as CUDA reads an index
    (UUIDS, tuple(UUIDS.split(","))),
    ("MIG-4f1e0d2c-aaaa-bbbb-cccc-ddddeeeeffff,MIG-0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff",
     ("MIG-4f1e0d2c-aaaa-bbbb-cccc-ddddeeeeffff", "MIG-0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff")),
    ("0,2,-1,1", ("0", "2")),  # CUDA stops at the first entry it cannot read
    ("", ()),  # set but empty: no GPU
    ("1,GPU-8c3e1f2a", ("1",)),  # a UUID after indices ends the list
    ("2,2", ()),  # an entry listed twice: CUDA sees no device at all
])
def test_visible_devices_reads_the_list_as_cuda_does(value, visible):
    assert visible_devices({} if value is None else {CVD: value}) == visible


def test_logical_k_is_entry_k_of_the_inherited_list(monkeypatch):
    monkeypatch.delenv(CVD, raising=False)
    assert [physical_device(f"cuda:{k}", "devices.rollout") for k in range(3)] == ["0", "1", "2"]
    assert physical_device("cpu", "devices.rollout") == "cpu" and physical_device("mps", "x") == "mps"
    monkeypatch.setenv(CVD, "2,3,6,7")  # a scheduler's allocation: cuda:0 is GPU 2, never GPU 0
    assert [physical_device(f"cuda:{k}", "devices.rollout") for k in range(4)] == ["2", "3", "6", "7"]
    monkeypatch.setenv(CVD, UUIDS)
    assert physical_device("cuda:1", "devices.learner") == UUIDS.split(",")[1]
    assert physical_device("cuda:0", "x", env={CVD: "5"}) == "5"  # an explicit environment over this process's


@pytest.mark.parametrize("value,listed", [("2,3,6,7", "lists 4 (2,3,6,7)"), ("", "lists no usable GPU"),
                                          (UUIDS, "lists 2 (GPU-8c3e1f2a")])
def test_an_index_beyond_the_list_is_one_line_naming_the_key_and_the_list(value, listed):
    with pytest.raises(UsageError) as e:
        physical_device("cuda:4", "devices.learner", env={CVD: value})
    msg = str(e.value)
    assert msg.startswith("devices.learner: cuda:4 is entry 4 of CUDA_VISIBLE_DEVICES") and listed in msg
    assert "\n" not in msg
    assert physical_device("cuda:0", "devices.learner", env={CVD: "2,3,6,7"}) == "2"  # control: within the list


def test_the_weight_bus_compares_physical_gpus(monkeypatch):
    """nccl_problem groups members by the GPU each logical device is: two names of one GPU are one GPU (the map
    is faked to give cuda:0 and cuda:1 one UUID), and distinct entries pass."""
    monkeypatch.setenv(CVD, "2,3,6,7")
    cfg = load_config(None, ["devices.rollout=0", "devices.learner=1"])
    assert nccl_problem(bus_members(cfg)) is None
    monkeypatch.setattr(weightbus, "physical_device", lambda d, key: "GPU-same" if d in ("cuda:0", "cuda:1") else d)
    assert "cuda:1/cuda:0 holds learner and engine" in nccl_problem(bus_members(cfg))
    monkeypatch.setattr(weightbus, "physical_device", devices.physical_device)
    monkeypatch.setenv(CVD, "2")  # the learner's cuda:1 is beyond a one-GPU list
    with pytest.raises(UsageError, match="learner: cuda:1 is entry 1"):
        nccl_problem(bus_members(cfg))
