"""``--engine sim --model DIR``: the sim engine of a checkpoint's config keeps that model's
pools and reuse rules, so it reuses exactly what a torch replica of it reuses, request by
request, and charges each layer kind its own cost."""

from __future__ import annotations

import random

import httpx
import pytest

from replicas.engines.base import SamplingParams, StepItem
from replicas.engines.sim import KEYS_PER_UNIT, SimEngine, SimTiming, _visible_keys
from tests.procs import Proc
from tests.replicas.models.checkpoints import VOCAB
from tests.replicas.models.serving import Served

TPB = 8
# window models (one with sinks), and hybrids: convolution, DeltaNet, Mamba-2, KDA with MLA
VARIANTS = ["gemma3", "qwen3-next", "nemotron-h", "gpt-oss", "lfm2", "kimi-linear"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def workload() -> list[list[list[int]]]:
    """Waves of prompts (each wave submitted together, the waves one after another) whose
    reuse the rules decide: a shared prefix longer than the windows, repeats, forks inside
    and past a block, a prompt ending on a block boundary, and a wave that preempts."""
    system = tokens(1, 37)
    history = system + tokens(2, 19)  # 56: ends on a block boundary
    return [
        [system + tokens(3, 6)],
        [system + tokens(4, 9), history],
        [history + tokens(5, 3), history[:27] + tokens(6, 4), system + tokens(3, 6)],
        [tokens(10 + i, 60) for i in range(3)],  # with 22 pages, one is preempted
        [history + tokens(5, 3) + tokens(7, 12), system[:20] + tokens(8, 30)],
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_sim_of_a_model_reuses_what_a_torch_replica_of_it_reuses(checkpoint, variant):
    directory, _ = checkpoint(variant)
    torch_side = Served(directory, TPB, pages=22, max_batched_tokens=24)
    sim_side = Served(directory, TPB, pages=22, max_batched_tokens=24, engine="sim")
    assert sim_side.engine.pool_names() == torch_side.engine.pool_names()
    assert sim_side.manager.config == torch_side.manager.config
    assert sim_side.engine.pool_page_bytes() == tuple(
        torch_side.manager.page_storage(i)[0].numel() * 4 for i in range(
            len(torch_side.engine.kinds)))
    got = {"torch": [], "sim": []}
    for wave in workload():
        for name, side in (("torch", torch_side), ("sim", sim_side)):
            runs = side.run(wave, max_tokens=8)
            got[name].append([(r.cached_tokens, r.cached_tokens_before_hybrid_pruning)
                              for r in runs])
    assert got["sim"] == got["torch"]
    assert sim_side.scheduler.preemptions == torch_side.scheduler.preemptions > 0


def test_each_layer_kind_costs_its_own():
    """A token costs one unit per layer, plus per KEYS_PER_UNIT keys an attention layer
    sees: a window caps them, a recurrent layer has none."""
    assert _visible_keys(0, 4, None) == 1 + 2 + 3 + 4
    assert _visible_keys(10, 3, None) == 11 + 12 + 13
    assert _visible_keys(0, 6, 3) == 1 + 2 + 3 + 3 + 3 + 3
    assert _visible_keys(5, 2, 3) == 3 + 3
    from replicas.models.base import AttentionSpec, ModelSpec, RecurrentSpec, StateSpec

    state = RecurrentSpec((StateSpec("h", (4,)),))
    spec = ModelSpec((AttentionSpec(1, 8), AttentionSpec(1, 8, window=100), state, None),
                     max_model_len=1 << 16, vocab_size=300)
    engine = SimEngine(SimTiming(), spec=spec)
    item = StepItem("s", None, [1] * 1000, 7000, SamplingParams())
    keys = _visible_keys(7000, 1000, None) + 1000 * 100
    assert engine._cost(item) == pytest.approx(1000 + keys / (KEYS_PER_UNIT * 4), rel=1e-12)
    plain = SimEngine(SimTiming())
    assert plain._cost(item) == 1000  # no spec: a token is a token, as before


def test_a_sim_replica_serves_the_checkpoints_pools(checkpoint):
    """``python -m replicas --engine sim --model DIR`` reads the config (no tokenizer in the
    directory: byte-level), has the model's pools, sized from --kv-cache-bytes as a torch
    replica's pages would be, and says so in /stats and /v1/models."""
    directory, _ = checkpoint("qwen3-next")
    sizes = Served(directory, 16, engine="sim").engine.pool_page_bytes()
    budget = 4 << 20
    with Proc("replicas", "--engine", "sim", "--model", str(directory), "--tokens-per-block",
              "16", "--kv-cache-bytes", str(budget), "--max-num-seqs", "4",
              "--log-level", "warning") as replica:
        stats = httpx.get(replica.url + "/stats").json()
        card = httpx.get(replica.url + "/v1/models").json()["data"][0]
    pools = stats["kv_cache"]["pools"]
    states = int(budget * 0.25) // sizes[1]
    assert [(p["life_cycle"], p["layers"], p["page_bytes"], p["num_pages"]) for p in pools] == [
        ("full_attention", 1, sizes[0], (budget - states * sizes[1]) // sizes[0]),
        ("recurrent", 3, sizes[1], states)]
    assert card["engine"]["engine"] == "sim"
    assert card["engine"]["architecture"] == "Qwen3NextForCausalLM"
    assert card["engine"]["layers"] == ["recurrent", "recurrent", "recurrent", "full"]
