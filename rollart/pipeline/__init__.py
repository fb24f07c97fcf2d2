"""The parts a pipeline driver composes around its step loop: the job's Clusters
(:mod:`~rollart.pipeline.clusters`), the rollout's env managers in groups (:mod:`~rollart.pipeline.env_groups`),
weight synchronisation
(:mod:`~rollart.pipeline.weight_sync`, one object per ``weights.channel``), trainer supervision and
recovery (:mod:`~rollart.pipeline.recovery`), checkpoints of the pipeline's own state
(:mod:`~rollart.pipeline.checkpoints`), reward services (:mod:`~rollart.pipeline.rewards`) and the step
records (:mod:`~rollart.pipeline.records`: ``metrics.jsonl``, ``ledger.json``, ``metrics.png``); and
after a run, the replay of its recorded batches (:mod:`~rollart.pipeline.replay`, ``rollart replay``).

The ready pipelines (:mod:`rollart.pipelines`, e.g. :class:`~rollart.pipelines.agentic.AgenticPipeline`)
are built from these."""
