"""``--model`` -> a local checkpoint directory.

A value naming an existing directory is used as is. Anything else is taken as a Hugging Face
hub id and looked up in the local hub cache only (``HF_HUB_CACHE`` / ``HF_HOME``); nothing is
downloaded, so a server never stalls on the network at start-up. An id that is not cached
fails with a message saying how to fetch it.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError


def resolve_checkpoint(
    name_or_path: str | Path, revision: str | None = None, cache_dir: str | Path | None = None,
) -> Path:
    """The checkpoint directory for a local path or a cached hub id.

    Raises ``ValueError`` when the path is not a checkpoint directory or the id is not in
    the local hub cache.
    """
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        _require_config(path, name)
        return path.resolve()
    if path.exists():
        raise ValueError(f"--model {name!r} is a file; pass a checkpoint directory or a hub id")
    try:
        snapshot = Path(
            snapshot_download(
                name, revision=revision, cache_dir=cache_dir, local_files_only=True
            )
        )
    except HFValidationError:
        raise ValueError(
            f"--model {name!r} is neither an existing directory nor a valid hub id "
            "(owner/name)"
        ) from None
    except LocalEntryNotFoundError:
        where = f" at {cache_dir}" if cache_dir else ""
        raise ValueError(
            f"--model {name!r} is not a local directory and is not in the Hugging Face "
            f"cache{where}; pagedserve does not download weights. Fetch it first, e.g. "
            f"`hf download {name}`, or pass a checkpoint directory."
        ) from None
    _require_config(snapshot, name)
    return snapshot


def _require_config(path: Path, name: str) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name!r}: no config.json in {path}")
