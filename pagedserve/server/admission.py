"""Admission control: how much work the server accepts, and when it stops accepting.

The bound counts *engine requests in flight* (admitted, not yet finished: running or
waiting), which is what occupies the engine; a request with ``n`` choices over ``p``
prompts counts ``n * p``. ``--max-queue Q`` lets at most ``Q`` of them wait beyond the
``--max-num-seqs`` that can run at once::

    capacity = max_num_seqs + max_queue

A request that would push the count past ``capacity`` is answered 429 at once instead of
being queued, and one that could never fit (``n * p > capacity``) gets 400. After
``close()`` (SIGTERM) every new request gets 503. Admission runs on the event loop thread
only, so the count is exact without a lock.
"""

from __future__ import annotations

from pagedserve.server.errors import APIError


class Admission:
    def __init__(self, max_num_seqs: int, max_queue: int | None) -> None:
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max-queue must be >= 0, got {max_queue}")
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.capacity = None if max_queue is None else max_num_seqs + max_queue
        self.num_in_flight = 0
        self.accepting = True

    def admit(self, num_requests: int) -> None:
        """Count ``num_requests`` engine requests in, or raise the 4xx/503 that refuses them."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           code="shutting_down")
        if self.capacity is None:
            self.num_in_flight += num_requests
            return
        if num_requests > self.capacity:
            raise APIError(400, f"this request needs {num_requests} engine requests (n x "
                           f"prompts), but the server holds at most {self.capacity} "
                           f"(max-num-seqs {self.max_num_seqs} + max-queue {self.max_queue})",
                           param="n")
        if self.num_in_flight + num_requests > self.capacity:
            raise APIError(
                429, f"the server is at capacity: {self.num_in_flight} requests in flight, "
                f"at most {self.capacity} (max-num-seqs {self.max_num_seqs} running + "
                f"max-queue {self.max_queue} waiting); retry later",
                code="queue_full", headers={"Retry-After": "1"})
        self.num_in_flight += num_requests

    def release(self, num_requests: int) -> None:
        self.num_in_flight -= num_requests
        if self.num_in_flight < 0:
            raise RuntimeError("admission released more requests than it admitted")

    def close(self) -> None:
        """Stop admitting (shutdown); requests already in flight are unaffected."""
        self.accepting = False
