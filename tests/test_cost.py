"""The cost ledger's attribution rule (``rollart.rollout.cost.BusyMeter``): a worker's busy time is split
among the requests in flight on it, so the shares sum to the busy time; a moved request is charged on both
workers; requests without a trajectory are counted as unattributed."""

import pytest

from rollart.rollout.cost import BusyMeter, TrajectoryCost, cost_by


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_workers_busy_time_is_split_among_the_requests_in_flight_and_a_moved_request_pays_on_both():
    clock = Clock()
    meter = BusyMeter("rollout", devices_of=lambda rank: {0: 2, 1: 0}[rank], clock=clock)
    a, b, c = TrajectoryCost(), TrajectoryCost(), TrajectoryCost()
    meter.begin("a", 0)  # t=100: a alone on rank 0 (2 devices)
    clock.now = 101.0
    meter.begin("b", 0)  # t=101: a and b share rank 0
    clock.now = 103.0
    meter.end("a")  # a: 1 s alone + 2 s shared = 2 worker-s
    meter.settle("a", a)
    clock.now = 104.0
    meter.move("b", 1)  # rank 0 died under b at t=104: b paid 1 + 1 s there, then goes on on rank 1 (a CPU)
    clock.now = 106.0
    meter.settle("b", b)
    clock.now = 110.0  # rank 0 idle from 104 to 110: nobody pays, and it is not busy
    meter.begin("e", 0)  # an eval request: no trajectory
    clock.now = 111.0
    meter.settle("e", None)
    meter.settle("c", c)  # never began: nothing charged
    assert a.worker_s == {"rollout": pytest.approx(2.0)} and a.device_s == {"rollout": pytest.approx(4.0)}
    assert b.worker_s == {"rollout": pytest.approx(4.0)} and b.device_s == {"rollout": pytest.approx(4.0)}
    assert a.generate_calls == 1 and b.generate_calls == 2 and c.worker_s == {} and c.generate_calls == 0
    busy = meter.busy()
    assert busy["by_rank"][0]["worker_s"] == pytest.approx(5.0) and busy["by_rank"][1]["worker_s"] == pytest.approx(2.0)
    assert busy["unattributed_worker_s"] == pytest.approx(1.0) and busy["unattributed_device_s"] == pytest.approx(2.0)
    # conservation: the shares (charged and unattributed) are the busy time
    assert a.worker_s["rollout"] + b.worker_s["rollout"] + busy["unattributed_worker_s"] == pytest.approx(
        busy["worker_s"]
    )
    assert a.device_s["rollout"] + b.device_s["rollout"] + busy["unattributed_device_s"] == pytest.approx(
        busy["device_s"]
    )
    rows = cost_by([("t1", a), ("t1", b), ("t2", c)])
    assert rows["t1"]["trajectories"] == 2 and rows["t1"]["worker_s"]["rollout"] == pytest.approx(6.0)
    assert rows["t1"]["device_s_total"] == pytest.approx(8.0) and rows["t2"]["worker_s"] == {}


def test_a_request_still_in_flight_counts_in_the_busy_time_up_to_now():
    clock = Clock()
    meter = BusyMeter("rollout", devices_of=lambda rank: 1, clock=clock)
    meter.begin("a", 0)
    clock.now = 103.0
    assert meter.busy()["worker_s"] == pytest.approx(3.0)
    clock.now = 104.0
    cost = TrajectoryCost()
    meter.settle("a", cost)
    assert cost.worker_s["rollout"] == pytest.approx(4.0) == meter.busy()["worker_s"]
