"""``pagedserve`` with faults patched into the engine, for the fault tests.

Run as ``python faulty_serve.py serve ...``. A request is marked by a stop string:

    FAULT_POSTPROCESS   its stop-string check raises (a per-request failure)
    FAULT_SAMPLING      its sampling settings raise (a per-request failure, found by
                        isolating the batch; the request must not be greedy)
    FAULT_FATAL         the next step raises a CUDA-like error (the engine dies)

and a route raises an unexpected exception for ``"model": "FAULT_ROUTE"``.
"""

from __future__ import annotations

import sys

from pagedserve.engine import llm_engine, sampler
from pagedserve.engine.request import Request
from pagedserve.server.context import ServingContext


def _marked(req: Request, mark: str) -> bool:
    return mark in req.params.stop


def install() -> None:
    stop_status = llm_engine.LLMEngine._stop_status

    def faulty_stop_status(self, req, token):  # type: ignore[no-untyped-def]
        if _marked(req, "FAULT_POSTPROCESS") and len(req.output_token_ids) >= 2:
            raise RuntimeError("injected fault in post-processing")
        return stop_status(self, req, token)

    from_requests = sampler.SamplingTensors.from_requests.__func__  # type: ignore[attr-defined]

    def faulty_from_requests(cls, requests, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(_marked(r, "FAULT_SAMPLING") for r in requests):
            raise RuntimeError("injected fault in sampling")
        return from_requests(cls, requests, *args, **kwargs)

    launch = llm_engine.LLMEngine._launch_scheduled

    def faulty_launch(self):  # type: ignore[no-untyped-def]
        if any(_marked(r, "FAULT_FATAL") for r in self.scheduler.running):
            raise RuntimeError("CUDA error: an illegal memory access was encountered "
                               "(injected)")
        return launch(self)

    check_model = ServingContext.check_model

    def faulty_check_model(self, name):  # type: ignore[no-untyped-def]
        if name == "FAULT_ROUTE":
            raise ZeroDivisionError("injected fault in a route")
        return check_model(self, name)

    ServingContext.check_model = faulty_check_model  # type: ignore[method-assign]
    llm_engine.LLMEngine._stop_status = faulty_stop_status  # type: ignore[method-assign]
    sampler.SamplingTensors.from_requests = classmethod(  # type: ignore[method-assign]
        faulty_from_requests)
    llm_engine.LLMEngine._launch_scheduled = faulty_launch  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from pagedserve.cli import main

    sys.exit(main(sys.argv[1:]))
