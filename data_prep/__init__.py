"""Offline data preparation: tokenise a corpus and write packed WebDataset shards."""

__version__ = "0.1.0"
