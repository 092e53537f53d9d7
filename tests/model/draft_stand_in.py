"""Stand-in draft graphs on the CPU: the runner's own ``DraftGraphs`` (buffers, loading,
padding, tails), each "replay" running the pass its graph captures over the static batch.

What a capture adds (no host syncs, fixed launches) only a GPU can check
(tests/engine/test_draft_graphs_gpu.py).
"""

from __future__ import annotations

from pagedserve.engine.draft_graphs import DraftGraphs
from pagedserve.engine.runner import ModelRunner
from pagedserve.model.forward_batch import ForwardBatch


class _Replay:
    """One stand-in graph: ``replay`` logs ``key`` in ``calls`` and runs ``fn``."""

    def __init__(self, fn, key: tuple, calls: list[tuple]) -> None:
        self.fn, self.key, self.calls = fn, key, calls

    def replay(self) -> None:
        self.calls.append(self.key)
        self.fn()


def stand_in_draft_graphs(runner: ModelRunner, max_batch: int, calls: list[tuple],
                          reference_host_copies: bool = True) -> DraftGraphs:
    """``runner``'s draft graphs of up to ``max_batch`` sequences, uncaptured.

    ``calls`` logs each replay: ``("propose", size, j)`` or ``("observe", size)``.
    ``reference_host_copies``: the observe pass's host copies describe the loaded rows
    (the CPU reference ops read them; the GPU kernels, which the graphs run, read only the
    device copies, so with the Triton branches leave it off)."""
    propose, observe = runner._draft_graph_parts(max_batch)
    if propose is not None:
        propose.graphs = {
            (s, j): _Replay(lambda s=s, j=j: propose.run_pass(s, j), ("propose", s, j), calls)
            for s in propose.sizes for j in range(1, propose.num_drafts)}
    if reference_host_copies:
        captured = observe.static_batch

        def described(size: int) -> ForwardBatch:
            batch = captured(size)
            batch.query_start_loc_cpu = batch.query_start_loc.tolist()
            batch.seq_lens_cpu = batch.seq_lens.tolist()
            return batch

        observe.static_batch = described  # type: ignore[method-assign]
    observe.graphs = {s: _Replay(lambda s=s: observe.run_pass(s), ("observe", s), calls)
                      for s in observe.sizes}
    return DraftGraphs(propose, observe)
