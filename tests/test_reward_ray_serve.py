"""The reward app on Ray Serve, autoscaling from zero replicas."""

import time

import httpx
import pytest

serve = pytest.importorskip("ray.serve")

from reward_fixtures import free_port  # noqa: E402

from rollart.reward.server import ServerSettings  # noqa: E402


@pytest.mark.timeout(300)
def test_ray_serve_deployment_scores_and_scales_from_zero(ray_local):
    from rollart.reward.ray_serve import deployment

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = deployment(["rollart.envs.rewards:reverse"], ServerSettings(), max_replicas=2, downscale_delay_s=1)
        serve.run(app, name="rollart-rewards", route_prefix="/")
        body = {
            "trajectories": [{"response": "cba", "ground_truth": "cba"}, {"response": "abc", "ground_truth": "cba"}]
        }
        url = f"http://127.0.0.1:{port}/rewards/reverse"
        r = httpx.post(url, timeout=60, json=body)
        assert r.status_code == 200 and r.json()["result"] == pytest.approx([1.0, 1 / 3])

        def replicas() -> int:
            dep = serve.status().applications["rollart-rewards"].deployments["rollart-rewards"]
            return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING"))

        end = time.monotonic() + 120
        while replicas() > 0:  # idle: autoscaling takes it down to zero replicas
            assert time.monotonic() < end, "never scaled to zero"
            time.sleep(0.5)
        again = httpx.post(url, timeout=120, json=body)  # and back up from zero on demand
        assert again.status_code == 200 and again.json()["result"] == pytest.approx([1.0, 1 / 3])
    finally:
        serve.shutdown()
