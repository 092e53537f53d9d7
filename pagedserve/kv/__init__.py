"""K/V cache memory management: storage formats, block pool, sequences, state slots."""
