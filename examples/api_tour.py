"""The declarative API of rollart, end to end on a laptop: three worker classes, resource pools as a
dict, a Cluster per role. Runs on a local Ray that rollart starts with logical H800/H20 devices.

    python examples/api_tour.py [REWARD_URL]

Without REWARD_URL the reward service is a small HTTP server this script starts on 127.0.0.1.
"""

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import rollart as ra

REWARD_URL = sys.argv[1] if len(sys.argv) > 1 else None


class ActorTrain(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.DP_SPLIT)  # split the batch across ranks, concatenate results
    def train_step(self, batch: ra.Batch) -> dict:
        return {"rank": self.rank, "rows": len(batch), "loss": float(batch["x"].float().mean())}

    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)  # "execute_all": same args to every rank, list back
    def save_checkpoint(self, path: str) -> None:
        self.logger.info("would save to %s", path)


class ActorInfer(ra.Worker):
    # tag -> ordered hardware preference; "*" is every other tag
    @ra.hw_mapping({"FrozenLake": ["H800", "H20"], "*": ["H20", "H800"]})
    async def generate(self, request: ra.GenerateRequest, tag_name: str) -> ra.GenerateOutput:
        tokens = list(reversed(request.prompt_token_ids))[: request.sampling.max_new_tokens]
        return ra.GenerateOutput(
            request_id=request.request_id,
            output_token_ids=tokens,
            finish_reason="stop",
            hardware=self.hardware,
            rank=self.rank,
        )


def reward_class(url: str) -> type:
    class Reward(ra.Worker):
        # never runs locally: the Cluster posts the arguments as JSON to the URL and returns the answer
        @ra.register_serverless(url=url, timeout_s=30, retries=5)
        def compute_rewards(self, trajectories: list[dict]) -> list[float]: ...

    return Reward


def start_local_reward_server() -> str:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            scores = [float(t["response"] == t["ground_truth"]) for t in body["trajectories"]]
            data = json.dumps({"result": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/rewards/exact"


async def main() -> dict:
    url = REWARD_URL or start_local_reward_server()
    rm = ra.ResourceManager(
        {  # the same dict is what a YAML config holds
            "train": {"hardware": "H800", "devices": 2},
            "rollout": [{"hardware": "H800", "devices": 2}, {"hardware": "H20", "devices": 4}],
            "env": {"hardware": "CPU", "cpus": 2},
        }
    )
    train = ra.Cluster("actor_train", ActorTrain, rm, pool="train")
    infer = ra.Cluster("actor_infer", ActorInfer, rm, pool="rollout", devices_per_worker=1)
    reward = ra.Cluster("reward", reward_class(url), rm, pool=None)  # serverless methods need no pool

    batch = ra.Batch({"x": torch.arange(5)})
    metrics = train.train_step(batch)  # dispatched, executed on all ranks, collected
    req = ra.GenerateRequest(request_id="r0", prompt_token_ids=[1, 2, 3])
    out = await infer.generate(req, tag_name="FrozenLake")  # an H800 worker; H20 only if no H800 is alive
    other = await infer.generate(req, tag_name="Sokoban")  # every other tag prefers H20
    trajs = [{"response": "cba", "ground_truth": "cba"}, {"response": "abc", "ground_truth": "cba"}]
    scores = reward.compute_rewards(trajs)  # HTTP POST, retried, never silently zero
    train.save_checkpoint("/tmp/ckpt")
    return {"metrics": metrics, "frozenlake_on": out.hardware, "sokoban_on": other.hardware, "scores": scores}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
