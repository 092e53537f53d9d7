"""``pagedserve generate``: the command-line contract of issue 4, run in-process."""

from __future__ import annotations

import json

import pytest

from pagedserve import cli

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def generate(capsys, *args: str) -> tuple[int, list[dict], str]:
    rc = cli.main(["generate", *args])
    cap = capsys.readouterr()
    lines = [json.loads(line) for line in cap.out.splitlines() if line.startswith("{")]
    return rc, lines, cap.err


def ids(prompt: list[int]) -> str:
    return ",".join(map(str, prompt))


def test_json_result_matches_transformers_greedy(capsys, model_dir, hf_greedy):
    rc, out, _ = generate(capsys, "--model", str(model_dir), "--prompt-token-ids", ids(PROMPT),
                          "--max-tokens", "20", "--temperature", "0", "--dtype", "float32",
                          "--json")
    assert rc == 0 and len(out) == 1
    assert set(out[0]) == {"token_ids", "text", "finish_reason"}
    want = hf_greedy(PROMPT, 20)
    # Greedy may stop early at the model's end-of-turn token; it never runs past 20.
    assert out[0]["token_ids"] == want[:len(out[0]["token_ids"])]
    assert out[0]["finish_reason"] == ("length" if len(out[0]["token_ids"]) == 20 else "stop")


@pytest.mark.parametrize("layout,kv", [("contiguous", "f16"), ("paged", "q4_0")])
def test_several_prompts_layouts_and_types(capsys, model_dir, layout, kv):
    rc, out, _ = generate(capsys, "--model", str(model_dir), "--prompt", "Hello", "--prompt",
                          "A longer second prompt", "--max-tokens", "6", "--temperature", "0.8",
                          "--seed", "3", "--kv-layout", layout, "--cache-type-k", kv,
                          "--cache-type-v", kv, "--json")
    assert rc == 0 and len(out) == 2
    assert all(o["finish_reason"] in ("stop", "length") for o in out)
    assert all(1 <= len(o["token_ids"]) <= 6 for o in out)


def test_reaching_max_model_len_finishes_with_length(capsys, model_dir):
    rc, out, _ = generate(capsys, "--model", str(model_dir), "--prompt-token-ids", ids(PROMPT),
                          "--max-tokens", "100", "--max-model-len", "20", "--temperature", "0",
                          "--json")
    assert rc == 0
    # Greedy might hit the end-of-turn token first; otherwise 8 tokens fill the context.
    assert out[0]["finish_reason"] == "length" or len(out[0]["token_ids"]) < 8
    assert len(out[0]["token_ids"]) <= 20 - len(PROMPT)


def test_default_model_needs_no_flag(capsys, model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(model_dir.parent))
    rc, out, _ = generate(capsys, "--prompt", "hi", "--max-tokens", "3", "--json")
    assert rc == 0 and 1 <= len(out[0]["token_ids"]) <= 3


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--max-tokens", "2", "--device", "tpu"], "device 'tpu' is not supported"),
    (["--max-tokens", "2", "--max-model-len", "1"], "max-model-len must be >= 2, got 1"),
])
def test_bad_options_fail_at_start_up(capsys, model_dir, args, message):
    rc, _, err = generate(capsys, "--model", str(model_dir), "--prompt", "x", *args)
    assert rc == 2 and message in err


def test_unknown_cache_type_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "x", "--max-tokens", "1", "--cache-type-k", "q5_0"])
    assert exc.value.code == 2
    assert "invalid choice: 'q5_0'" in capsys.readouterr().err
