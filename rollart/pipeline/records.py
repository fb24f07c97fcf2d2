"""A pipeline's step records: one record per step (``metrics.jsonl`` and the trackers of ``tracking:``),
its per-task part, the learning diagnostics of a batch, the trajectory ledger (``ledger.json``) and
``metrics.png``."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollart.rollout.sample_buffer import Group

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds of one step: waiting for the batch, training, the weight sync, and the whole step."""

    rollout_wait_s: float
    train_s: float
    weight_sync_s: float
    step_s: float


def pool_devices(rm: Any) -> dict[str, int]:
    """The accelerator devices each pool of the job holds now (CPU groups and colocated pools, which share
    another pool's devices, are not counted)."""
    from rollart.resource_manager.specs import CPU

    out: dict[str, int] = {}
    for name, spec in rm.specs.items():
        if spec.colocate_with:
            continue
        n = sum(rm.group_devices(name, i) for i, g in enumerate(spec.groups) if g.hardware != CPU)
        if n:
            out[name] = n
    return out


def step_cost(before: dict[str, int], after: dict[str, int], step_s: float, samples: int) -> dict[str, Any]:
    """Device-seconds of one step per pool (the devices held at its start and end, averaged, times its
    wall time), in all, and per trained sample (trajectory)."""
    per_pool = {p: round((before.get(p, 0) + after.get(p, 0)) / 2 * step_s, 4) for p in sorted({*before, *after})}
    total = sum(per_pool.values())
    return {"device_s": per_pool, "device_s_total": round(total, 4), "device_s_per_sample": total / max(samples, 1)}


def trajectory_cost(
    groups: list[Group], scheduler: Any, busy_before: dict[str, Any], busy_after: dict[str, Any]
) -> dict[str, Any]:
    """The cost ledger's part of a step's ``cost``: what the trained trajectories were charged
    (:mod:`rollart.rollout.cost`), in all (``trained``), per task (``by_task``) and per env tag (``by_tag``),
    and the inference pool's busy seconds during the step (``busy``: every request's share, also those of
    trajectories that were not trained)."""
    from rollart.rollout.cost import cost_by, empty_row

    trained = [(scheduler.task_of(g), t) for g in groups for t in g]
    pool = busy_after.get("pool", "")
    return {
        "trained": cost_by(("all", t.cost) for _, t in trained).get("all", empty_row()),
        "by_task": cost_by((task, t.cost) for task, t in trained),
        "by_tag": cost_by((t.tag, t.cost) for _, t in trained),
        "busy": {
            pool: {
                k: round(busy_after[k] - busy_before.get(k, 0.0), 6)
                for k in ("worker_s", "device_s", "unattributed_worker_s")
            }
        },
    }


def run_cost(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's cost from its step records (``cost.json``, the run summary): device-seconds the pools held
    (``device_s``, ``device_s_total``), the inference pool's busy seconds (``busy``), what the trained
    trajectories were charged (``trained``, and ``by_task``, ``by_tag``), and per trained sample."""
    held: dict[str, float] = defaultdict(float)
    busy: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    sums: dict[str, dict[str, dict[str, Any]]] = {"by_task": {}, "by_tag": {}}
    trained: dict[str, Any] = {}
    for rec in records:
        cost = rec.get("cost", {})
        for pool, v in cost.get("device_s", {}).items():
            held[pool] += v
        for pool, parts in cost.get("busy", {}).items():
            for k, v in parts.items():
                busy[pool][k] += v
        if "trained" in cost:
            _add_row(trained, cost["trained"])
        for key in sums:
            for name, row in cost.get(key, {}).items():
                _add_row(sums[key].setdefault(name, {}), row)
    samples = int(trained.get("trajectories", 0))
    total = sum(held.values())
    busy_device = sum(b["device_s"] for b in busy.values())
    return {
        "steps": len(records),
        "trained_trajectories": samples,
        "device_s": dict(held),
        "device_s_total": total,
        "device_s_per_trained_sample": total / samples if samples else None,
        "busy": {p: dict(b) for p, b in busy.items()},
        "busy_device_s_per_trained_sample": busy_device / samples if samples else None,
        "trained": trained,
        **sums,
    }


def _add_row(into: dict[str, Any], row: dict[str, Any]) -> None:
    """Add one :func:`~rollart.rollout.cost.cost_by` row to ``into`` (numbers added, per-pool maps merged)."""
    for k, v in row.items():
        if isinstance(v, dict):
            sub = into.setdefault(k, {})
            for p, x in v.items():
                sub[p] = sub.get(p, 0.0) + x
        else:
            into[k] = into.get(k, 0) + v


def write_cost(out_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``cost.json``: the run's cost (:func:`run_cost`) from every step's record."""
    cost = run_cost(records)
    (out_dir / "cost.json").write_text(json.dumps(cost, indent=2))
    return cost


def batch_statistics(batch: Any, trajs: list) -> dict[str, Any]:
    """Per-step learning diagnostics: the advantages of the action tokens (mean, std, fraction exactly
    0: tied groups and tied token positions carry no signal) and, for tags with dense credit, the mean
    credit at each action position (for reverse: the accuracy of each answer character)."""
    import torch

    adv = torch.tensor(
        [a for row, mask in zip(batch["advantages"], batch["loss_mask"]) for a, m in zip(row, mask) if m],
        dtype=torch.float64,
    )
    out: dict[str, Any] = {
        "advantage": {
            "mean": float(adv.mean()) if adv.numel() else 0.0,
            "std": float(adv.std(unbiased=False)) if adv.numel() else 0.0,
            "frac_zero": float((adv == 0).double().mean()) if adv.numel() else 0.0,
        }
    }
    sums: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    for t in trajs:
        if t.token_rewards is None:
            continue
        s, c = sums[t.tag], counts[t.tag]
        for k, x in enumerate(_action_credits(t)):
            if k == len(s):
                s.append(0.0)
                c.append(0)
            s[k] += float(x)
            c[k] += 1
    if sums:
        out["credit_by_position"] = {tag: [x / n for x, n in zip(sums[tag], counts[tag])] for tag in sums}
        out["dead_by_position"] = _dead_by_position(trajs)
    return out


def _action_credits(t: Any) -> list[float]:
    """The credit of each action token of a trajectory with dense credit (0 past its token rewards)."""
    return [t.token_rewards[i] if i < len(t.token_rewards) else 0.0 for i, m in enumerate(t.loss_mask) if m]


def _dead_by_position(trajs: list) -> dict[str, list[float]]:
    """Per tag and action position: the fraction of groups in which no member got any credit there.
    Such a position is tied, so its group-relative advantage is exactly 0: it learns nothing until a
    member happens to get it right (a position stuck at 1.0 is a plateau)."""
    groups: dict[str, list] = defaultdict(list)
    for t in trajs:
        if t.token_rewards is not None:
            groups[t.group_id].append(t)
    dead: dict[str, list[int]] = defaultdict(list)
    seen: dict[str, list[int]] = defaultdict(list)
    for members in groups.values():
        tag = members[0].tag
        credits = [_action_credits(t) for t in members]
        for k in range(max(len(c) for c in credits)):
            d, s = dead[tag], seen[tag]
            if k == len(s):
                d.append(0)
                s.append(0)
            s[k] += 1
            d[k] += all(k >= len(c) or c[k] == 0 for c in credits)
    return {tag: [d / s for d, s in zip(dead[tag], seen[tag])] for tag in seen}


def step_record(
    *,
    step: int,
    version: int,
    trajs: list,
    train_metrics: dict,
    times: StepTimes,
    staleness: Counter,
    scheduler: Any,
    proxy: Any,
    weight_load_s: float,
    rewards: Any,
) -> dict[str, Any]:
    """The record of one step (``metrics.jsonl``): rewards (overall and per tag), hardware per tag,
    times, staleness, tokens, the run's trajectory and fault counts, the ledger, the reward services'
    counts (``rewards``: the pipeline's :class:`~rollart.pipeline.rewards.RewardServices`) and the mean
    of each training metric."""
    by_tag: dict[str, list[float]] = defaultdict(list)
    hw_by_tag: dict[str, Counter] = defaultdict(Counter)
    for t in trajs:
        by_tag[t.tag].append(float(t.reward))
        for hw in t.hardware:
            hw_by_tag[t.tag][hw] += 1
    tokens = sum(t.num_action_tokens for t in trajs)
    counts = scheduler.counts
    rewards_ = [float(t.reward) for t in trajs]
    return {
        "step": step + 1,  # steps done, counted from 1: the record of step N matches checkpoint step-N
        "version": version,
        "groups": sorted({t.group_id for t in trajs}),
        "reward_mean": sum(rewards_) / len(rewards_),
        "reward_by_tag": {k: sum(v) / len(v) for k, v in by_tag.items()},
        "hardware_by_tag": {k: dict(v) for k, v in hw_by_tag.items()},
        # routing: auto — the tags whose hardware order the measured shapes changed
        **({"routing": proxy.affinity.mapping()} if proxy.affinity is not None else {}),
        "time": {
            "step_s": times.step_s,
            "rollout_wait_s": times.rollout_wait_s,
            "train_s": times.train_s,
            "weight_sync_s": times.weight_sync_s,
            "weight_load_s": weight_load_s,
        },
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "max_staleness": max((int(k) for k in staleness), default=0),
        "tokens": tokens,
        "tokens_per_s": tokens / max(times.step_s, 1e-9),
        "trajectories_aborted": counts.get("trajectories_aborted", 0),
        "trajectories_failed": counts.get("trajectories_failed", 0),
        "trajectories_reward_failed": counts.get("trajectories_reward_failed", 0),
        "groups_evicted_stale": counts.get("groups_evicted_stale", 0),
        "faults": proxy.fault_metrics(),
        "ledger": step_ledger(scheduler, trajs),
        **rewards.counts(),
        "train": {k: (sum(v) / len(v) if isinstance(v, list) else v) for k, v in train_metrics.items()},
    }


def task_record(
    scheduler: Any,
    groups: list[Group],
    stale_before: dict[str, Counter],
    held_back: dict[str, int],
    quotas: dict[str, int] | None,
) -> dict[str, Any]:
    """Per task tag: ``groups_by_tag`` (groups in this batch) and ``by_tag`` — groups, trajectories,
    reward mean/min/max, mean response length (action tokens), tokens, mean trajectory wall time
    (reset to reward) and its quantiles, this batch's staleness,
    the groups held back in the buffer for later batches, and the run's trajectory counts so far
    (ok, aborted, failed, reward_failed, evicted) and its quota (``tasks.*.ratio``) if any."""
    out: dict[str, Any] = {}
    for tag in scheduler.counts_by_task:
        mine = [g for g in groups if scheduler.task_of(g) == tag]
        trajs = [t for g in mine for t in g]
        rewards = [float(t.reward) for t in trajs if t.reward is not None]
        lengths = [t.num_action_tokens for t in trajs]
        durations = [float(t.info["duration_s"]) for t in trajs if "duration_s" in t.info]
        staleness = scheduler.staleness_by_task[tag] - stale_before.get(tag, Counter())
        counts = scheduler.counts_by_task[tag]
        out[tag] = {
            "groups": len(mine),
            "trajectories": len(trajs),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "reward_min": min(rewards, default=None),
            "reward_max": max(rewards, default=None),
            "response_length_mean": sum(lengths) / len(lengths) if lengths else None,
            "tokens": sum(lengths),
            "trajectory_s_mean": sum(durations) / len(durations) if durations else None,
            # min, p25, p50, p75, p90, max of the trajectories' wall times (rollart advise's tail)
            "trajectory_s_quantiles": (
                np.quantile(durations, (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)).tolist() if durations else None
            ),
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "max_staleness": max(staleness, default=0),
            "held_back_groups": held_back.get(tag, 0),
            "quota": None if quotas is None else quotas.get(tag),
            **{
                key: counts.get(f"trajectories_{key}", 0)
                for key in ("ok", "aborted", "failed", "reward_failed", "evicted")
            },
        }
    return {"groups_by_tag": {t: v["groups"] for t, v in out.items()}, "by_tag": out}


def ledger(scheduler: Any, trajs: list) -> dict[str, int]:
    """The trajectory ledger after a step that trained ``trajs`` (checked once here:
    :meth:`~rollart.rollout.scheduler.RolloutScheduler.audit_trained`)."""
    scheduler.audit_trained(trajs)
    out = scheduler.ledger()
    out["trained_twice"] += scheduler.counts["trajectories_trained_twice_in_step"]
    out["rewards_invented"] = scheduler.counts["rewards_invented"]
    return out


def step_ledger(scheduler: Any, trajs: list) -> dict[str, int]:
    """The per-step ledger: while rounds are being completed, what ``lost`` would count is
    ``completing`` (``ledger.json``, written after the rollout stopped, has the exact ``lost``)."""
    out = ledger(scheduler, trajs)
    out["completing"] = out.pop("lost")
    return out


def write_ledger(out_dir: Path, scheduler: Any, proxy: Any, rewards: Any) -> None:
    """``ledger.json`` at the end of a run (after the rollout stopped, so ``lost`` is exact)."""
    led: dict[str, Any] = ledger(scheduler, [])
    led["migrated"] = int(proxy.fault_metrics().get("migrated", 0))
    if rewards.client is not None:  # what the job sent its reward service, all of it (clients closed)
        led["reward_service"] = rewards.client.counts()
    (out_dir / "ledger.json").write_text(json.dumps(led, indent=2))
    (log.info if led["lost"] == 0 and led["trained_twice"] == 0 else log.error)("trajectory ledger: %s", led)


class MetricsFile:
    """``metrics.jsonl`` of a run folder: the trackers that write it, reading it back, trimming it for a
    resume, and ``metrics.png``."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"

    def tracker(self, config: Any) -> Any:
        """``metrics.jsonl`` (always) and the backends of ``tracking:`` (TensorBoard, W&B, MLflow)."""
        from rollart.tracking import make_tracker

        return make_tracker(
            ["jsonl", *config.tracking],
            self.out_dir,
            run_name=config.name,
            config=config.model_dump(mode="json"),
            resume=True,  # a fresh run's metrics.jsonl was removed by reset(); a resumed one appends
        )

    def reset(self) -> None:
        """A fresh run: no records of an earlier one."""
        if self.path.exists():
            self.path.unlink()

    def drop_from(self, step: int) -> None:
        """A resume continues after step ``step`` (its checkpoint's): drop the records a killed driver logged
        past it, so ``metrics.jsonl`` has one record per step."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", -1) <= step]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)

    def read(self) -> list[dict[str, Any]]:
        """Every step's record, in step order (a step done again after a trainer restore: its last record)."""
        if not self.path.exists():
            return []
        by_step: dict[int, dict[str, Any]] = {}
        with self.path.open() as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    by_step[rec["step"]] = rec
        return [by_step[k] for k in sorted(by_step)]

    def plot(self, history: list[dict[str, Any]], title: str) -> Path | None:
        """``metrics.png`` (needs matplotlib: the ``plot`` extra); None when skipped."""
        if not history:
            return None
        try:
            import matplotlib
        except ImportError:
            log.info(
                "metrics.png skipped: matplotlib is not installed; the metrics are in %s "
                "(pip install 'rollart[plot]', then `rollart plot %s` draws it)",
                self.path,
                self.out_dir,
            )
            return None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        evals = [h for h in history if "eval" in h]
        fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
        _plot_rewards(axes[0], history)
        _plot_times(axes[1], history)
        if evals:
            plot_eval(axes[2], evals)
        fig.suptitle(title)
        fig.tight_layout()
        path = self.out_dir / "metrics.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _plot_rewards(ax: Any, history: list[dict[str, Any]]) -> None:
    steps = [h["step"] for h in history]
    for tag in sorted({t for h in history for t in h["reward_by_tag"]}):
        ax.plot(steps, [h["reward_by_tag"].get(tag, float("nan")) for h in history], label=tag)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()


def _plot_times(ax: Any, history: list[dict[str, Any]]) -> None:
    steps = [h["step"] for h in history]
    bottom = [0.0] * len(history)
    for part in ("rollout_wait_s", "train_s", "weight_sync_s"):
        vals = [h["time"][part] for h in history]
        ax.bar(steps, vals, bottom=bottom, label=part)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend()


def plot_eval(ax: Any, evals: list[dict[str, Any]]) -> None:
    """Held-out accuracy and mean reward per eval tag, and overall pass@k, against the step."""
    steps = [h["step"] for h in evals]
    tags = sorted({t for h in evals for t in h["eval"]["by_tag"]})
    for tag in tags:
        for key, style in (("accuracy", "o-"), ("mean_reward", "s:")):
            ax.plot(
                steps,
                [h["eval"]["by_tag"].get(tag, {}).get(key, float("nan")) for h in evals],
                style,
                label=f"{tag} {key.replace('_', ' ')}",
            )
    for key in sorted(k for k in evals[-1]["eval"] if k.startswith("pass@")):
        ax.plot(steps, [h["eval"].get(key, float("nan")) for h in evals], "--", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("eval")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
