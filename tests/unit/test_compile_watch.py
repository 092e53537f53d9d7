"""``compile_watch``: compiles after a warm-up are named in a warning and counted."""

from __future__ import annotations

import logging

import torch

from pagedserve.engine import compile_watch


def test_armed_watch_reports_a_new_guard_set(caplog) -> None:
    f = torch.compile(lambda x: x * 2 + 1)
    compile_watch.disarm()
    f(torch.ones(3))  # a warm-up's own compile: not reported
    before = compile_watch.compiles_after_warm_up()
    compile_watch.arm()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedserve.engine.compile_watch"):
            f(torch.ones(3))  # the same guards: no compile
            assert compile_watch.compiles_after_warm_up() == before
            f(torch.ones(3, dtype=torch.float64))  # a new dtype: dynamo traces again
    finally:
        compile_watch.disarm()
    assert compile_watch.compiles_after_warm_up() == before + 1
    assert "compile after warm-up" in caplog.text
    f(torch.ones(3, dtype=torch.int64))  # disarmed again
    assert compile_watch.compiles_after_warm_up() == before + 1


def test_installed_hook_tolerates_constants_json_cannot_encode() -> None:
    """Triton encodes a new specialization's constants for the compile hook; a Gluon
    layout object is not JSON, and the launch must not fail on it."""
    from triton.runtime import jit

    class Layout:  # stands in for Gluon's DistributedLinearLayout
        pass

    compile_watch.arm()
    compile_watch.disarm()
    options = type("Options", (), {})()
    data = jit.serialize_specialization_data("k", {"x": "*fp32"}, {("L",): Layout()}, {},
                                             options, "key")
    assert data is None
    plain = jit.serialize_specialization_data("k", {"x": "*fp32"}, {("n",): 4}, {},
                                              options, "key")
    assert '"constant_vals": [4]' in plain


def test_a_triton_compile_is_named_with_its_specialization() -> None:
    """The report names the kernel, its argument types, constexprs and the attributes
    (alignment, divisibility) that a specialization differs by."""
    fn = type("Info", (), {"name": "my_kernel"})()
    compile_info = {
        "signature": {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
        "constants": {(2,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}],
        "num_warps": 4, "num_stages": 3,
    }
    line = compile_watch.describe_triton_compile({"fn": fn, "compile": compile_info})
    assert line.startswith("Triton kernel my_kernel [num_warps=4, num_stages=3]")
    assert "x_ptr: *bf16, n: i32" in line
    assert "BLOCK=64" in line
    assert "x_ptr: [['tt.divisibility', 16]]" in line
