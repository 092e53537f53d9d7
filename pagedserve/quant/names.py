"""The weight quantization names, importable without torch (the CLI offers them as
choices); ``config.py`` defines what each one means."""

QUANTIZATIONS: tuple[str, ...] = ("fp8",)
