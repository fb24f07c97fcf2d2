"""The built-in tiny model and tokenizer, built offline."""

from rollart.models.tiny import build_tiny, default_corpus, default_tiny_path

__all__ = ["build_tiny", "default_corpus", "default_tiny_path"]
