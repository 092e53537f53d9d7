"""Several sequences in one ForwardBatch (decode rows + prefill chunks) = each run alone.

Three prompts of different lengths start at different steps and are prefilled in chunks
while the others decode, so steps mix decode rows with one or two prefill chunks. Every
sequence's logits must equal those of the same sequence run alone, and its greedy tokens
must equal transformers'.
"""

from __future__ import annotations

import torch
from greedy_driver import GreedyDriver, greedy
from hybrid_checkpoints import hf_reference, prompt_ids

NEW = 12


def test_mixed_batch_matches_each_sequence_alone(checkpoints) -> None:
    ckpt = checkpoints("d256-gqa3-untied")
    runner = ckpt.runner(max_num_seqs=3)
    prompts = [ckpt.prompt, prompt_ids(1, 20), prompt_ids(2, 9)]
    chunk = 8
    driver = GreedyDriver(runner)
    seqs = [driver.new_sequence() for _ in prompts]
    fed = [0, 0, 0]  # prompt tokens already forwarded
    starts = [0, 6, 8]  # step at which each sequence arrives
    step = 0
    mixed_steps = 0
    while any(len(s.tokens) < NEW for s in seqs):
        decodes, prefills = [], []
        for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
            if step < starts[i] or len(seq.tokens) >= NEW:
                continue
            if fed[i] < len(prompt):
                ids = prompt[fed[i] : fed[i] + chunk]
                fed[i] += len(ids)
                prefills.append((i, ids))
            else:
                decodes.append((i, [seq.tokens[-1]]))
        work = decodes + prefills
        mixed_steps += bool(decodes) and bool(prefills)
        logits = driver.step([(seqs[i], ids) for i, ids in work])
        for row, (i, _) in enumerate(work):
            if fed[i] == len(prompts[i]):  # end of prompt or a decode: sample
                seqs[i].step_logits.append(logits[row].cpu())
                seqs[i].tokens.append(int(logits[row].argmax()))
        step += 1
    assert mixed_steps >= 3
    assert max(b.num_seqs for b in driver.batches) == 3
    for seq in seqs:
        driver.free(seq)

    for seq, prompt in zip(seqs, prompts):
        alone = greedy(runner, prompt, NEW, chunk=chunk)
        assert seq.tokens == alone.tokens
        # A batch's row count changes the GEMMs' blocking, so float32 sums round in another
        # order: logits of unit scale move by ~1e-5. Any mix-up of rows moves them by ~1.
        torch.testing.assert_close(
            torch.stack(seq.step_logits), torch.stack(alone.step_logits), atol=1e-4, rtol=1e-4
        )
        assert seq.tokens == hf_reference(ckpt.hf_model, prompt, NEW).tokens
