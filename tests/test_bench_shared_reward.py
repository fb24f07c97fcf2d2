"""`rollart bench shared-reward` with tiny settings: three real jobs (driver processes running the
pipeline) on one namespace host share one reward service as three tenants; every job's own count of
scored trajectories equals the service's per-tenant metric. No timing is asserted."""

import argparse

import pytest

from rollart.benchmarks import shared_reward
from rollart.testing.hosts import skip_reason

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]


def test_three_jobs_share_one_reward_service_and_its_tenant_metrics_equal_their_counts(tmp_path):
    p = argparse.ArgumentParser()
    shared_reward.add_arguments(p)
    args = p.parse_args(
        ["--modes", "shared", "--steps", "2", "--devices", "2", "--reward-devices", "1", "--shared-devices", "3"]
        + ["--groups", "2", "--group-size", "2", "--tokens", "4", "--reward-ms", "10", "--out", str(tmp_path)]
    )
    result = shared_reward.run(args)
    shared = result["modes"]["shared"]
    assert shared["reward_services"] == 1 and shared["rollout_devices_per_job"] == 1 and shared["devices_in_all"] == 6
    assert set(shared["tenants"]) == {"job0", "job1", "job2"}
    for tenant, counts in shared["tenants"].items():
        # two steps of 2 groups x 2: at least 8 trajectories scored, every one counted once on both sides
        assert counts["job_trajectories"] >= 8, tenant
        assert counts["job_trajectories"] == counts["service_trajectories"], tenant
        assert counts["job_failed"] == 0, tenant
    assert result["counts_match"] is True
    assert 0 < result["shared_utilisation"] <= 1.0 and result["shared_rollout_s"] > 0
    assert result["seed_utilisation"] == "6% -> 88%" and (tmp_path / "shared-reward.json").exists()


def test_a_layout_that_does_not_split_evenly_is_refused_before_anything_starts():
    p = argparse.ArgumentParser()
    shared_reward.add_arguments(p)
    with pytest.raises(ValueError, match="--shared-devices 2"):
        shared_reward._layout(p.parse_args(["--devices", "4", "--shared-devices", "2"]), "shared")
    with pytest.raises(ValueError, match="--reward-devices"):
        shared_reward._layout(p.parse_args(["--devices", "2", "--reward-devices", "2"]), "dedicated")
