"""Every family served as a replica serves it, against transformers.

For each variant in ``FAMILY_VARIANTS`` (a tiny random checkpoint saved by transformers'
``save_pretrained``, fp32, CPU), through the replica's own ``Scheduler`` and ``TorchEngine``
(``serving.Served``):

- prefill logits within 1e-4 of transformers' forward, whole and in chunks;
- greedy continuations of 16 tokens identical to ``generate``: cold, with a reused prefix
  longer than every window, resumed turn after turn, forked from a shared history, and in a
  batch of different lengths arriving at different steps (each identical to its solo run);
- preemption under page pressure and chunked prefill at several chunk sizes change no
  output;
- every reuse is the exact figure the manager's rules give (windows: any prefix; recurrent
  layers: only where a snapshot was kept), and the probe at submission says so.
"""

from __future__ import annotations

import random

import pytest
import torch

from replicas.engines.base import StepItem
from tests.replicas.models.checkpoints import FAMILY_VARIANTS, VOCAB
from tests.replicas.models.serving import N_NEW, Served, hf_generate, hf_logits

TPB = 8
ATOL = 1e-4


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def recurrent(served: Served) -> bool:
    return "recurrent" in served.engine.kinds


@pytest.fixture(params=FAMILY_VARIANTS)
def family(request, checkpoint):
    return checkpoint(request.param)


def test_prefill_logits_match_transformers(family):
    """Whole, and in chunks crossing block and window boundaries (a recurrent state carried
    from chunk to chunk): each chunk's last logits equal transformers' at that position."""
    directory, hf = family
    prompt = tokens(1, 40)
    expected = hf_logits(hf, prompt)
    for chunks in ([40], [5, 11, 9, 15]):
        served = Served(directory, TPB)
        cache = served.manager.create_kv_cache(prompt[:-1])
        assert cache.resize(len(prompt))
        pos = 0
        for size in chunks:
            got = served.engine.forward_logits(
                [StepItem("s", cache, prompt[pos:pos + size], pos, None)])[0]
            cache.commit(prompt[pos:pos + size])
            pos += size
            torch.testing.assert_close(got, expected[pos - 1], atol=ATOL, rtol=0)
        cache.close()


def test_cold_and_a_shared_prefix_longer_than_every_window(family):
    """A 37-token shared prefix (longer than the windows of 12, ending inside a block). The
    second request reuses all of it on attention-only models; with recurrent layers none
    (no snapshot inside it yet: the first's prefill stopped only at its last block boundary,
    40, past where they diverge; the second's stops at 32, where the attention layers
    matched a block, and at 40); the third (the first again) reuses its prompt but the last
    token on attention-only models, the snapshot at its last block boundary (40) with
    recurrent layers."""
    directory, hf = family
    system = tokens(2, 37)
    first, second = system + tokens(3, 6), system + tokens(4, 9)
    served = Served(directory, TPB)
    runs = [served.one(prompt) for prompt in (first, second, first)]
    expected = [0, 0, 40] if recurrent(served) else [0, 37, len(first) - 1]
    assert [r.cached_tokens for r in runs] == [r.probed for r in runs] == expected
    assert [r.cached_tokens_before_hybrid_pruning for r in runs] == [0, 37, len(first) - 1]
    assert runs[0].tokens == runs[2].tokens == hf_generate(hf, first)
    assert runs[1].tokens == hf_generate(hf, second)


def test_a_conversation_resumes_each_turn_where_the_last_one_ended(family):
    """Each turn's prompt is the last one's, its answer and a new message: it reuses all of
    the history the last turn computed (its prompt and all but the last answer token), also
    with recurrent layers (the state snapshotted where that history ended, mid-block)."""
    directory, hf = family
    served = Served(directory, TPB)
    prompt, history = tokens(10, 30), 0
    for turn in range(3):
        run = served.one(prompt)
        assert run.tokens == hf_generate(hf, prompt), f"turn {turn}"
        assert run.cached_tokens == run.probed == history, f"turn {turn}"
        history = len(prompt) + N_NEW - 1
        prompt = prompt + run.tokens + tokens(11 + turn, 7)


def test_forks_from_a_shared_history_reuse_what_the_snapshots_allow(family):
    """A 40-token history (its prefill commit ends on a block boundary: a snapshot at 40)
    and its answer; then forks at 27 (before any snapshot) and at 44 (between the snapshots
    at 40 and 48). The attention layers match 27 and 44; recurrent layers allow 0 and 40."""
    directory, hf = family
    served = Served(directory, TPB)
    history = tokens(20, 40)
    answer = served.one(history).tokens
    forks = [history[:27] + tokens(21, 9), history + answer[:4] + tokens(22, 5)]
    runs = [served.one(prompt) for prompt in forks]
    expected = [0, 40] if recurrent(served) else [27, 44]
    assert [r.cached_tokens for r in runs] == [r.probed for r in runs] == expected
    assert [r.cached_tokens_before_hybrid_pruning for r in runs] == [27, 44]
    for run, prompt in zip(runs, forks):
        assert run.tokens == hf_generate(hf, prompt)


def test_a_batch_arriving_at_different_steps_matches_each_solo_run(family):
    """Four requests of different lengths join at steps 0, 1, 3 and 4 with 16-token
    prefill chunks, so steps mix prefill chunks and decodes; the last shares the first's
    first 24 tokens."""
    directory, hf = family
    prompts = [tokens(5, 30), tokens(6, 45), tokens(7, 3), tokens(5, 24) + tokens(8, 10)]
    batched = Served(directory, TPB, max_batched_tokens=16).run(prompts, [0, 1, 3, 4])
    assert batched[3].cached_tokens_before_hybrid_pruning == 24
    for run, prompt in zip(batched, prompts):
        solo = Served(directory, TPB).one(prompt)
        assert run.tokens == solo.tokens == hf_generate(hf, prompt)


@pytest.mark.parametrize("chunk", [8, 24, 40])
def test_chunk_sizes_and_preemption_change_no_output(family, chunk):
    """Three 60-token prompts at once with few pages: the newest is preempted (its pages
    freed, recomputed later, mostly from the cache), and prefill runs in chunks of
    ``chunk``. Every output is transformers' all the same."""
    directory, hf = family
    prompts = [tokens(30 + i, 60) for i in range(3)]
    served = Served(directory, TPB, pages=22, max_batched_tokens=chunk)
    runs = served.run(prompts)
    assert served.scheduler.preemptions > 0
    for run, prompt in zip(runs, prompts):
        assert run.tokens == hf_generate(hf, prompt)
