"""rollart: RL post-training of LLM agents on heterogeneous, disaggregated clusters."""

__version__ = "0.1.0"
