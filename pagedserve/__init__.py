"""pagedserve: a serving engine for Qwen3.5/3.6 dense hybrid models on a paged K/V cache."""

__version__ = "0.1.0"
