"""The CLI half of issue 32: every engine flag is checked before any weight loads (a
checkpoint path that does not exist proves it: the flag is reported, not the path),
``plan`` refuses lengths it cannot plan, sampling flags are named, and ``--help`` imports
neither torch nor the server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve import cli

MISSING = "/nonexistent/checkpoint"


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flag, value, message", [
    ("--num-blocks", "0", "num-blocks must be >= 1, got 0"),
    ("--max-num-seqs", "0", "max-num-seqs must be >= 1, got 0"),
    ("--max-num-batched-tokens", "-3", "max-num-batched-tokens must be >= 1, got -3"),
    ("--prefill-chunk", "0", "prefill-chunk must be >= 1, got 0"),
    ("--max-model-len", "1", "max-model-len must be >= 2, got 1"),
    ("--gpu-memory-utilization", "1.5", "gpu-memory-utilization must be in (0, 1]"),
    ("--block-size", "7", "block_size must be one of"),
])
def test_engine_flags_fail_before_the_model_loads(capsys, command, flag, value, message):
    extra = ["--prompt", "x", "--max-tokens", "1"] if command == "generate" else []
    rc = cli.main([command, "--model", MISSING, *extra, flag, value])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err and MISSING not in err


@pytest.mark.parametrize("flag, value, message", [
    ("--top-k", "-2", "--top-k must be -1 or 0 (no top-k) or a positive integer, got -2"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--temperature", "nan", "--temperature must be in [0, 100], got nan"),
    ("--seed", str(2**64), f"--seed must be a 64-bit integer, in [-2**63, 2**64), got {2**64}"),
])
def test_generate_names_a_bad_sampling_flag(capsys, flag, value, message):
    rc = cli.main(["generate", "--model", MISSING, "--prompt", "x", "--max-tokens", "1",
                   flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_generate_top_k_beyond_the_vocabulary_means_no_top_k(capsys, model_dir):
    def run(top_k: str) -> list[int]:
        rc = cli.main(["generate", "--model", str(model_dir), "--prompt-token-ids", "1,2,3",
                       "--max-tokens", "6", "--temperature", "1.0", "--seed", "5",
                       "--top-k", top_k, "--json"])
        out = capsys.readouterr().out.splitlines()
        assert rc == 0
        return json.loads(out[-1])["token_ids"]

    assert run(str(2**63)) == run("0")


@pytest.mark.parametrize("args, message", [
    (["--max-model-len", "0"], "--max-model-len must be in [2, 262144]"),
    (["--max-model-len", "300000"], "--max-model-len must be in [2, 262144]"),
    (["--seq-lens", "999999999"], "--seq-lens 999999999 is longer than the planned maximum "
                                  "length 262144"),
    (["--max-model-len", "8192", "--seq-lens", "4096,8193"], "--seq-lens 8193"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
])
def test_plan_refuses_lengths_it_cannot_plan(capsys, args, message):
    rc = cli.main(["plan", "--model", "preset:qwen3.5-27b", "--memory", "40GiB", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_plan_seq_lens_within_the_maximum(capsys):
    rc = cli.main(["plan", "--model", "preset:qwen3.5-27b", "--memory", "40GiB",
                   "--max-model-len", "8192", "--seq-lens", "8192,4096x2", "--json"])
    assert rc == 0
    assert "workload" in json.loads(capsys.readouterr().out)


def test_help_imports_neither_torch_nor_the_server():
    code = ("import sys, contextlib, io\n"
            "from pagedserve import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    for argv in (['--help'], ['serve', '--help'], ['generate', '--help'],\n"
            "                 ['plan', '--help'], ['bench', 'serve', '--help']):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'uvicorn', 'fastapi')\n"
            "         if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
