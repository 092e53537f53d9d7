"""The package's layers import downwards only: each module's imports, read from its source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pagedserve"


def imported_modules(path: Path) -> set[str]:
    """Every ``pagedserve`` module that ``path`` imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a.b import c`` imports ``a.b.c`` (a module or a name in ``a.b``).
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("pagedserve")}


def imports_of(subpackage: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(PACKAGE)): imported_modules(path)
        for path in sorted((PACKAGE / subpackage).glob("*.py"))
    }


def offending(subpackage: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]) -> dict:
    """Imports of ``subpackage`` under a ``forbidden`` prefix and not under an ``allowed`` one."""
    bad = {}
    for module, names in imports_of(subpackage).items():
        hits = sorted(
            n for n in names
            if any(n == f or n.startswith(f + ".") for f in forbidden)
            and not any(n == a or n.startswith(a + ".") for a in allowed)
        )
        if hits:
            bad[module] = hits
    return bad


def test_layer_rule_sees_imports() -> None:
    """The reader finds from-imports of modules and of names (so the rules can fail)."""
    names = imported_modules(PACKAGE / "engine" / "runner.py")
    assert "pagedserve.kernels.ops.DecodeWorkspace" in names
    assert "pagedserve.kv.formats" in names  # from pagedserve.kv import formats
    assert offending("engine", (), ("pagedserve.kernels",)) != {}


@pytest.mark.parametrize(
    ("subpackage", "allowed", "forbidden"),
    [
        # The engine reaches the kernels only through the public op API.
        ("engine", ("pagedserve.kernels.ops",), ("pagedserve.kernels",)),
        # The model runs a step; building one is the engine's work.
        ("model", (), ("pagedserve.engine", "pagedserve.server", "pagedserve.commands")),
        # The K/V cache is mechanism: it knows nothing of the config, model or engine.
        ("kv", (), ("pagedserve.config", "pagedserve.model", "pagedserve.engine",
                    "pagedserve.kernels", "pagedserve.plan")),
        ("kernels", (), ("pagedserve.config", "pagedserve.model", "pagedserve.engine",
                         "pagedserve.server")),
        # Tensor parallelism's group and sharding rules sit under the model (which uses
        # them); only its launcher and runner know the engine.
        ("parallel", ("pagedserve.parallel", "pagedserve.model", "pagedserve.engine",
                      "pagedserve.config", "pagedserve.kv", "pagedserve.quant"),
         ("pagedserve.server", "pagedserve.commands")),
        # The FP8 weight format is a leaf, like the K/V formats.
        ("quant", (), ("pagedserve.config", "pagedserve.model", "pagedserve.engine",
                       "pagedserve.kernels", "pagedserve.kv", "pagedserve.plan")),
    ],
)
def test_layers_import_downwards(subpackage: str, allowed: tuple[str, ...],
                                 forbidden: tuple[str, ...]) -> None:
    assert offending(subpackage, allowed, forbidden) == {}
