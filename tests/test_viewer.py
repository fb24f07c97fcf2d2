"""``rollart view RUN_DIR``: the page of a real run's folder (a small job with traces on), served by the
command itself on 127.0.0.1. Its JSON API agrees with the run's files and follows a run that is still
writing them; in a real browser (Debian's chromium, headless, driven by Playwright) the page draws the
reward curve, filters the trajectories by reward, opens one and shows its tokens and events, with every
request that is not to 127.0.0.1 blocked and none attempted."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from test_pipeline import small_config

from rollart.cli.run_dir import LOCK
from rollart.tracking.traces import lives, read_traces
from rollart.tracking.viewer import tokens as viewer_tokens
from rollart.training import batch_record
from rollart.training import columns as C
from rollart.training.batch_record import read_step, read_trainer

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def run_dir(ray_local, tmp_path_factory):
    """A real run's folder: 2 steps of two reverse tasks (alpha 1, groups of 4), every trajectory traced,
    every trained batch recorded (``record_batches``)."""
    from rollart.pipelines.agentic import AgenticPipeline

    tmp = tmp_path_factory.mktemp("viewed")
    cfg = small_config(
        tmp,
        steps=2,
        checkpoint_every=0,
        traces={"enabled": True},
        record_batches=True,
        envs=[
            {"name": "reverse", "groups": 2, "kwargs": {"length": 3}},
            {"name": "reverse", "groups": 2, "kwargs": {"length": 2}},
        ],
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        pipe.run()
    finally:
        pipe.shutdown()
    return tmp / "run"


class Viewer:
    """``rollart view RUN_DIR --port 0`` in its own process; ``url`` from the line it logs."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollart.cli", "view", str(folder), "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stderr is not None
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stderr], daemon=True).start()
        seen = []
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail(f"rollart view logged no URL; it wrote: {seen}")
            seen.append(line)
            found = re.search(r"http://127\.0\.0\.1:\d+/", line)
            if found:
                self.url = found.group(0)
                return

    def get(self, path: str, **params):
        r = httpx.get(self.url + path.lstrip("/"), params=params, timeout=30)
        return r

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def append_events(folder: Path, *events: dict) -> None:
    with (folder / "traces.jsonl").open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def batch_row(folder: Path, traj_id: str, step: int) -> dict:
    """The row of ``traj_id`` in the batch record of ``step``, one list or number per column."""
    batch, _ = read_step(folder / "batches", step)
    r = batch[C.TRAJ_ID].index(traj_id)
    return {k: (batch[k][r].tolist() if hasattr(batch[k][r], "tolist") else batch[k][r]) for k in batch}


def _reward(life) -> float | None:
    rewards = [e["reward"] for e in life.events if e["event"] in ("reward", "trained") and "reward" in e]
    return rewards[-1] if rewards else None


def expected_rows(folder: Path, lo: float | None, hi: float | None) -> set[str]:
    """The trajectories a reward filter keeps, from traces.jsonl: the reward of its last reward or trained
    event, within [lo, hi] (one without a reward is left out)."""
    out = set()
    for life in lives(read_traces(folder)):
        r = _reward(life)
        if r is not None and (lo is None or r >= lo) and (hi is None or r <= hi):
            out.add(life.traj_id)
    return out


def test_the_api_reads_the_run_folder_and_follows_a_run_still_writing_it(run_dir, tmp_path):
    from transformers import AutoTokenizer

    v = Viewer(run_dir)
    try:
        assert urlparse(v.url).hostname == "127.0.0.1"
        run = v.get("/api/run").json()
        all_lives = lives(read_traces(run_dir))
        assert run["steps"] == 2 and run["trajectories"] == len(all_lives) > 0
        assert run["tags"] == ["reverse-2", "reverse-3"] and run["ledger"]["trained"] == 2 * 2 * 4
        assert run["live"] is False  # no run holds the folder
        recs = records(run_dir)
        curves = v.get("/api/curves").json()
        assert curves["steps"] == [1, 2]
        assert curves["series"]["reward"]["mean"] == [r["reward_mean"] for r in recs]
        assert curves["series"]["step_time"]["train_s"] == [r["time"]["train_s"] for r in recs]
        assert curves["series"]["throughput"]["tokens/s"] == [r["tokens_per_s"] for r in recs]
        assert curves["series"]["staleness"]["max"] == [r["max_staleness"] for r in recs]

        # every generate call is on its worker's lane, and each step's training on the trainer's
        tl = v.get("/api/timeline").json()
        gens = [e for life in all_lives for e in life.events if e["event"] == "generate"]
        assert len([s for s in tl["spans"] if s["kind"] == "generate"]) == len(gens)
        assert "trainer" in tl["lanes"] and len([s for s in tl["spans"] if s["kind"] == "train"]) == 2
        assert all(s["start"] <= s["end"] for s in tl["spans"])

        # filters: by task, status and reward, exactly the traces' trajectories that pass
        rows = v.get("/api/trajectories", tag="reverse-2", status="trained").json()["rows"]
        assert len(rows) == 1 * 2 * 4 and {r["tag"] for r in rows} == {"reverse-2"}
        for lo, hi in ((0.0, 0.0), (0.5, None), (None, 1.0)):
            params = {k: x for k, x in (("reward_min", lo), ("reward_max", hi)) if x is not None}
            got = v.get("/api/trajectories", limit=5000, **params).json()
            assert {r["traj_id"] for r in got["rows"]} == expected_rows(run_dir, lo, hi)
            assert got["total"] == len(got["rows"])
        stale = v.get("/api/trajectories", staleness_min=1).json()["rows"]
        assert all(r["staleness"] >= 1 and r["outcome"] == "trained" for r in stale)

        # one trajectory: its events as traced, its turns with their token counts
        first = next(r for r in v.get("/api/trajectories", status="trained").json()["rows"])
        one = v.get(f"/api/trajectories/{first['id']}").json()
        life = all_lives[first["id"]]
        assert one["traj_id"] == life.traj_id and [e["event"] for e in one["events"]] == [
            e["event"] for e in life.events
        ]
        calls = [c for turn in one["turns"] for c in turn["calls"]]
        assert [c["response_tokens"] for c in calls] == [
            e["response_tokens"] for e in life.events if e["event"] == "generate"
        ]
        assert one["content"] == []  # the traces hold no per-token data ...

        # ... the batch record does: the trajectory's row of the step that trained it, token by token
        assert run["batch_record"] is True and one["per_token_note"] is None
        assert (viewer_tokens.FOLDER, viewer_tokens.TRAINER_FILE) == (batch_record.FOLDER, batch_record.TRAINER_FILE)
        tokens = one["tokens"]
        row = batch_row(run_dir, life.traj_id, first["step"])
        assert tokens["step"] == first["step"] and tokens["token_ids"] == row[C.INPUT_IDS]
        assert tokens["logprobs"] == row[C.BEHAVIOUR_LOGPROBS] and tokens["loss_mask"] == row[C.LOSS_MASK]
        assert tokens["versions"] == row[C.VERSIONS] and tokens["advantages"] == row[C.ADVANTAGES]
        assert tokens["reward"] == row[C.REWARDS] == first["reward"]
        assert 0 < sum(tokens["loss_mask"]) < len(tokens["token_ids"])  # prompt and action tokens both
        tokenizer = AutoTokenizer.from_pretrained(read_trainer(run_dir / "batches")["train"]["model"])
        assert tokens["tokenizer_error"] is None and tokens["text"] == [
            tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i in row[C.INPUT_IDS]
        ]
        actions = [t for t, m in zip(tokens["text"], tokens["loss_mask"]) if m]
        assert "".join(actions).strip() != ""  # the response, as text
        assert v.get("/api/trajectories/100000").status_code == 404
        assert v.get("/api/trajectories", status="nonsense").status_code == 422
        assert v.get("/static/../data.py").status_code == 404 and v.get("/static/secrets").status_code == 404
    finally:
        v.close()

    # live: a copy of the folder a run goes on writing; the API shows each new step once its line is whole
    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    v = Viewer(live)
    try:
        # a trajectory the record does not hold (its step's file unreadable) says where tokens come from
        (live / "batches" / f"step-{first['step']:08d}.pt").write_bytes(b"not a step file")
        gone = v.get(f"/api/trajectories/{first['id']}").json()
        assert gone["tokens"] is None and "record_batches: true" in gone["per_token_note"]
        # a model folder gone since the run: the token ids, and why there is no text
        trainer = json.loads((live / "batches" / "trainer.json").read_text())
        trainer["train"]["model"] = str(tmp_path / "moved")
        (live / "batches" / "trainer.json").write_text(json.dumps(trainer))
        other = next(
            r for r in v.get("/api/trajectories", status="trained").json()["rows"] if r["step"] != first["step"]
        )
        ids = v.get(f"/api/trajectories/{other['id']}").json()["tokens"]
        assert ids["text"] is None and "tokenizer could not be loaded" in ids["tokenizer_error"]
        assert ids["token_ids"] == batch_row(run_dir, other["traj_id"], other["step"])[C.INPUT_IDS]
        # a step file written again (a resumed run records its steps anew) is read again, not served from memory
        (live / "batches" / f"step-{other['step']:08d}.pt").write_bytes(b"recorded again, cut short")
        assert v.get(f"/api/trajectories/{other['id']}").json()["tokens"] is None
        before = v.get("/api/run").json()
        (live / LOCK).write_text(f"{v.proc.pid}\n")  # a live rollart process names itself in the lock
        assert v.get("/api/run").json()["live"] is True
        record = {**recs[-1], "step": 3, "reward_mean": 0.75}
        line = json.dumps(record) + "\n"
        with (live / "metrics.jsonl").open("a") as f:
            f.write(line[:40])  # a line being written is not read yet
        assert v.get("/api/run").json()["steps"] == 2
        with (live / "metrics.jsonl").open("a") as f:
            f.write(line[40:])
        after = v.get("/api/run").json()
        assert after["steps"] == 3 and after["stamp"] != before["stamp"]
        assert v.get("/api/curves").json()["series"]["reward"]["mean"][-1] == 0.75

        # faults and joins on the timeline: a worker that died under a call (its lane), a failed
        # trajectory (the env lane), a worker joining the elastic pool (its lane)
        t = max(e["t"] for e in read_traces(live)) + 1
        append_events(
            live,
            {
                "traj_id": "9:0:0:v3",
                "event": "created",
                "t": t,
                "tag": "reverse-3",
                "group": 9,
                "round": 0,
                "member": 0,
            },
            {
                "traj_id": "9:0:0:v3",
                "event": "migrate",
                "t": t + 0.1,
                "turn": 0,
                "from_rank": 7,
                "from_hardware": "H20",
                "from_node_ip": "127.0.0.1",
                "error": "ActorDiedError",
                "tokens_kept": 0,
            },
            {"traj_id": "9:0:0:v3", "event": "failed", "t": t + 0.2, "status": "failed", "error": "step 0: boom"},
        )
        with (live / "elastic.jsonl").open("a") as f:
            f.write(
                json.dumps({"event": "joined", "time": t + 0.3, "rank": 8, "hardware": "H800", "node_ip": "127.0.0.1"})
                + "\n"
            )
        tl = v.get("/api/timeline").json()
        marks = {(m["lane"], m["kind"]) for m in tl["marks"]}
        assert marks == {
            ("rollout 7 (H20, 127.0.0.1)", "fault"),
            ("env", "fault"),
            ("rollout 8 (H800, 127.0.0.1)", "join"),
        }
        assert {"rollout 7 (H20, 127.0.0.1)", "rollout 8 (H800, 127.0.0.1)"} <= set(tl["lanes"])
        (failed,) = v.get("/api/trajectories", status="failed").json()["rows"]
        assert failed["traj_id"] == "9:0:0:v3" and failed["why"] == "step 0: boom" and failed["migrated"]
        untrained = v.get(f"/api/trajectories/{failed['id']}").json()  # not trained: no tokens, the same note
        assert untrained["tokens"] is None and "record_batches: true" in untrained["per_token_note"]

        # lines that are not trace events are passed over
        with (live / "traces.jsonl").open("a") as f:
            f.write(
                '[1, 2]\n{"traj_id": "9:0:1:v3", "event": "created"}\n{"traj_id": 5, "event": "x", "t": 1}\nnot json\n'
            )
        assert v.get("/api/trajectories").json()["total"] == len(all_lives) + 1
        assert v.get("/api/timeline").status_code == 200

        # a new run in the folder (traces.jsonl started anew): read from its start
        (live / "traces.jsonl").unlink()
        append_events(live, {"traj_id": "", "event": "trace_started", "t": t, "sample": 1.0, "seed": 0})
        assert v.get("/api/run").json()["trajectories"] == 0
    finally:
        v.close()


def test_rollart_view_refuses_a_missing_folder_and_a_port_in_use(run_dir, caplog):
    from rollart.cli import main

    assert main(["view", str(run_dir / "nope")]) == 2
    assert "is not a folder" in caplog.text
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["view", str(run_dir), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text and "--port" in caplog.text
    assert main(["view", str(run_dir), "--port", "70000"]) == 2


def _browser():
    """Playwright and Debian's chromium, or a skip (a failure under CI=true) saying what is missing."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "playwright is not installed (the dev extra: pip install -e '.[dev]')"
        sync_playwright = None
    if problem is None and not os.path.exists(CHROMIUM):
        problem = f"{CHROMIUM} is missing (Debian's chromium: apt-get install chromium; scripts/test.sh does it)"
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the viewer's browser test must run in CI: {problem}")
        pytest.skip(problem)
    return sync_playwright


def test_the_page_draws_the_curves_filters_by_reward_and_opens_a_trajectory_offline(run_dir, tmp_path):
    sync_playwright = _browser()
    from transformers import AutoTokenizer

    folder = tmp_path / "run"  # a copy the test goes on writing, as a live run would
    shutil.copytree(run_dir, folder)
    recs = records(folder)
    steps = len(recs)
    scored = {r for life in lives(read_traces(folder)) for r in [_reward(life)] if r is not None}
    lo = min((r for r in scored if r > 0), default=0.0)  # the lowest reward above 0, when one is
    wanted = expected_rows(folder, lo, None)
    assert 0 < len(wanted) < 200 and (lo == 0.0 or len(wanted) < len(expected_rows(folder, None, None)))
    # a trajectory whose error holds markup: shown as text, never run as part of the page
    hostile = '<img src=x onerror="document.body.dataset.pwned=1">'
    t = max(e["t"] for e in read_traces(folder)) + 1
    append_events(
        folder,
        {"traj_id": "9:0:0:v3", "event": "created", "t": t, "tag": "reverse-3", "group": 9, "round": 0, "member": 0},
        {"traj_id": "9:0:0:v3", "event": "failed", "t": t + 0.1, "status": "failed", "error": hostile},
    )
    viewer = Viewer(folder)
    blocked: list[str] = []
    errors: list[str] = []
    with viewer, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context()

            def route(r):
                if urlparse(r.request.url).hostname == "127.0.0.1":
                    r.continue_()
                else:
                    blocked.append(r.request.url)
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(viewer.url)
            page.wait_for_selector("body[data-loaded=true]", timeout=60_000)

            # the reward curve: one point per step, for the mean and each task
            mean = page.locator("#chart-reward polyline[data-name=mean]")
            assert len(mean.get_attribute("points").split()) == steps
            assert page.locator("#chart-reward polyline").count() == 3  # mean, reverse-2, reverse-3
            for chart in ("throughput", "step_time", "staleness"):
                assert page.locator(f"#chart-{chart} polyline").count() >= 1
            assert page.locator("#timeline-svg rect.span-generate").count() > 0

            # filter by reward: exactly the traced trajectories scored within the bound
            page.fill("input[name=reward_min]", str(lo))
            page.fill("input[name=reward_max]", "")
            page.click("#filters button[type=submit]")
            page.wait_for_function(
                "n => document.getElementById('traj-count').textContent.startsWith(n + ' trajectories')",
                arg=len(wanted),
            )
            ids = page.locator("#traj-table tbody tr td:first-child").all_text_contents()
            assert set(ids) == wanted
            page.fill("input[name=reward_min]", "2")  # no reward is above 1
            page.click("#filters button[type=submit]")
            page.wait_for_function("() => document.getElementById('traj-count').textContent.startsWith('0 ')")
            assert page.locator("#traj-table tbody tr").count() == 0
            page.fill("input[name=reward_min]", "")
            page.select_option("select[name=status]", "trained")
            page.click("#filters button[type=submit]")
            page.wait_for_function("() => !document.getElementById('traj-count').textContent.startsWith('0 ')")

            # open one: its tokens per turn and its events, as traced
            row = page.locator("#traj-table tbody tr").first
            traj_id = row.locator("td").first.text_content()
            row.click()
            page.wait_for_selector("#traj-title")
            assert page.text_content("#traj-title") == traj_id
            (life,) = [x for x in lives(read_traces(run_dir)) if x.traj_id == traj_id]
            gens = [e for e in life.events if e["event"] == "generate"]
            shown = page.locator("#traj-turns td.response-tokens").all_text_contents()
            assert shown == [str(e["response_tokens"]) for e in gens]
            events = page.locator("#traj-events tbody tr td:nth-child(2)").all_text_contents()
            assert events == [e["event"] for e in life.events]
            # its tokens from the batch record: each token's text, its log-prob, action tokens apart
            row = batch_row(folder, traj_id, life.end["step"])
            chips = page.locator("#batch-tokens .btok")
            assert chips.count() == len(row[C.INPUT_IDS])
            assert page.locator("#batch-tokens .btok.action").count() == sum(row[C.LOSS_MASK])
            masks = [
                int(x) for x in page.eval_on_selector_all("#batch-tokens .btok", "els => els.map(e => e.dataset.mask)")
            ]
            assert masks == row[C.LOSS_MASK]
            a = row[C.LOSS_MASK].index(1)
            chip = chips.nth(a)
            assert float(chip.get_attribute("data-logprob")) == row[C.BEHAVIOUR_LOGPROBS][a]
            assert f"id {row[C.INPUT_IDS][a]}" in chip.get_attribute("title") and "log-prob" in chip.get_attribute(
                "title"
            )
            assert chip.locator(".btok-lp").text_content() != ""  # the log-prob under an action token
            tokenizer = AutoTokenizer.from_pretrained(read_trainer(folder / "batches")["train"]["model"])
            shown = chip.locator(".btok-text").text_content()
            assert shown == tokenizer.decode([row[C.INPUT_IDS][a]], skip_special_tokens=False) or shown == "\u2205"
            assert chips.nth(row[C.LOSS_MASK].index(0)).locator(".btok-lp").text_content() == ""  # none: a prompt token
            assert page.locator("#per-token-note").count() == 0

            # the hostile trajectory: its error as text
            page.select_option("select[name=status]", "failed")
            page.click("#filters button[type=submit]")
            page.wait_for_function("() => document.getElementById('traj-count').textContent.startsWith('1 ')")
            page.locator("#traj-table tbody tr").first.click()
            page.wait_for_function("() => document.getElementById('traj-title').textContent === '9:0:0:v3'")
            assert hostile in page.text_content("#traj-detail")
            assert (
                page.locator("#traj-detail img").count() == 0 and page.evaluate("document.body.dataset.pwned") is None
            )

            # live: a step the run records later is drawn without reloading the page
            with (folder / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({**recs[-1], "step": steps + 1}) + "\n")
            page.wait_for_function(
                "n => document.querySelector('#chart-reward polyline[data-name=mean]')"
                ".getAttribute('points').split(' ').length === n",
                arg=steps + 1,
            )
        finally:
            browser.close()
    assert errors == []
    assert blocked == []  # the page asked nothing of any other host
