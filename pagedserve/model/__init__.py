"""The Qwen3.5/3.6 hybrid decoder, its checkpoint loader, and the embedded default model."""
