"""The weight bus's publisher: what it sends for each (need, have), including a request that comes
before the learner's first offer (remote servers asking for the run's starting weights)."""

import queue
import threading

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


def test_publisher_waits_for_tensors_the_asker_lacks():
    bus, want = FakeBus(), queue.Queue()
    pub = Publisher(bus, want, version=3)
    want.put((3, -1))  # a server that holds nothing of the run yet: must get version 3's tensors
    threading.Event().wait(0.2)
    assert bus.sent == []  # not "nothing newer": the tensors were not offered yet
    pub.offer(3, {"w": torch.zeros(1)}, 0.0)
    want.put((3, 3))  # the asker has 3 now: nothing newer
    want.put((5, 3))  # waits for version 5
    threading.Event().wait(0.2)
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
