"""The weight bus's publisher: what it sends for each (need, have), including a request that comes
before the learner's first offer (remote servers asking for the run's starting weights)."""

import queue
import threading
import time

import torch

from tsrl_cli.rl.weightbus import Publisher


class FakeBus:
    def __init__(self):
        self.sent = []

    def send(self, version, tensors, at):
        self.sent.append(version)
        return 8

    def send_nothing(self):
        self.sent.append(None)


def wait_until(cond, timeout=60.0):
    """Until cond() holds (the publisher is a thread: a loaded machine runs it late, never wrongly)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "the publisher did not get there"
        time.sleep(0.01)


def test_publisher_waits_for_tensors_the_asker_lacks():
    bus, want = FakeBus(), queue.Queue()
    pub = Publisher(bus, want, version=3)
    want.put((3, -1))  # a server that holds nothing of the run yet: must get version 3's tensors
    wait_until(want.empty)  # the publisher holds the request
    threading.Event().wait(0.2)  # room for a wrong answer (a load can only shorten it, never fail the test)
    assert bus.sent == []  # not "nothing newer": the tensors were not offered yet
    pub.offer(3, {"w": torch.zeros(1)}, 0.0)
    want.put((3, 3))  # the asker has 3 now: nothing newer
    want.put((5, 3))  # waits for version 5
    wait_until(lambda: len(bus.sent) >= 2 and want.empty())
    threading.Event().wait(0.2)  # room for a wrong answer to (5, 3)
    assert bus.sent == [3, None]
    pub.offer(5, {"w": torch.ones(1)}, 1.0)
    want.put(None)
    pub.close(timeout=10)
    assert bus.sent == [3, None, 5]


def test_publisher_answers_nothing_newer_without_tensors_when_the_asker_is_current():
    bus, want = FakeBus(), queue.Queue()
    pub = Publisher(bus, want, version=2)
    want.put((1, 2))  # async: the rollout side holds 2 already
    want.put(None)
    pub.close(timeout=10)
    assert bus.sent == [None]


# ---- the bus's backend: a pure function of the members' devices -----------------------------------
def _cfg(rollout, learner, *extra):
    from tsrl_cli.config import load_config

    return load_config(sets=[f"devices.rollout={rollout}", f"devices.learner={learner}", *extra])


def test_co_located_cuda_members_pick_gloo():
    """Rollout and learner on cuda:0: NCCL would refuse two ranks on one GPU, so auto picks gloo."""
    from tsrl_cli.rl.weightbus import bus_backend, bus_members, choose_backend, nccl_problem

    cfg = _cfg("0", "0")
    assert bus_members(cfg) == [("learner", "cuda:0"), ("engine", "cuda:0")]
    assert bus_backend(cfg) == "gloo"
    assert "cuda:0 holds learner and engine" in nccl_problem(bus_members(cfg))
    assert choose_backend([("a", "cuda:1"), ("b", "cuda:1")]) == "gloo"


def test_disjoint_cuda_members_pick_nccl():
    from tsrl_cli.rl.weightbus import bus_backend, bus_members, nccl_problem

    cfg = _cfg("0-3", "4-7")  # the node8 placement: the learner group's rank 0 on cuda:4
    assert bus_members(cfg) == [("learner", "cuda:4"), *[(f"engine-{i}", f"cuda:{i}") for i in range(4)]]
    assert nccl_problem(bus_members(cfg)) is None and bus_backend(cfg) == "nccl"
    assert bus_backend(_cfg("0,2,3", "4-7")) == "nccl"  # opd's placement (the teacher on 1 is no member)


def test_mixed_placements():
    """One shared GPU among distinct ones, a CPU member, a vLLM replica of two devices: gloo; forced stays."""
    from tsrl_cli.rl.weightbus import bus_backend, bus_members, choose_backend, nccl_problem

    shared = _cfg("0,4", "4-7")  # engine-1 on cuda:4, the learner's rank 0 too
    assert bus_backend(shared) == "gloo" and "cuda:4 holds learner and engine-1" in nccl_problem(bus_members(shared))
    assert bus_backend(_cfg("0", "cpu")) == "gloo"  # a CPU learner
    assert "learner (cpu) is not" in nccl_problem(bus_members(_cfg("0", "cpu")))
    tp = _cfg("0-3", "2-3", "rollout.engine=vllm", "rollout.tensor_parallel=2")  # replicas (0,1), (2,3)
    assert bus_members(tp) == [("learner", "cuda:2"), ("engine-0", "cuda:0"), ("engine-1", "cuda:2")]
    assert bus_backend(tp) == "gloo"
    assert bus_backend(_cfg("0-1", "2-3", "rollout.engine=vllm", "rollout.tensor_parallel=2")) == "nccl"
    assert bus_backend(_cfg("0", "0", "rollout.weight_sync_backend=nccl")) == "nccl"  # forced: tsrl doctor flags it
    assert choose_backend([("a", "cuda:0"), ("b", "cuda:0")], "nccl") == "nccl"
