"""The K/V storage type names, importable without torch (the CLI offers them as choices);
``formats.py`` defines what each one is."""

KV_TYPES: tuple[str, ...] = ("f16", "bf16", "q8_0", "q4_0", "f32")
