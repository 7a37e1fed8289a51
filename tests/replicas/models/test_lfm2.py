"""LFM2 specifics: its pools and pages, the conv state against transformers' cache, and the
config fields it refuses."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from kvcache import FullAttention, Recurrent
from replicas.checkpoint import read_config
from replicas.engines.base import StepItem
from replicas.models import CheckpointError
from tests.replicas.models.checkpoints import VOCAB
from tests.replicas.models.serving import Served

TPB = 8


def test_pools_and_pages_follow_the_layer_types(checkpoint):
    """conv, full_attention, conv: one attention layer in the full pool (4 heads of 16, 2 of
    them K/V), two convolution layers in the recurrent pool, each with 64 channels x 2
    earlier inputs (conv_L_cache 3) as float32."""
    directory, hf = checkpoint("lfm2")
    served = Served(directory, TPB, pages=16)
    assert served.manager.config.life_cycles == (FullAttention(), Recurrent())
    assert [layout.shape for layout in served.engine.page_layouts()] == [
        (1, 2, TPB, 2, 16), (2, 64 * 2)]
    assert served.engine.describe()["layers"] == ["recurrent", "full", "recurrent"]
    assert served.engine.describe()["parameters"] == hf.num_parameters()
    assert read_config(directory).intermediate_size == 96  # 2/3 of 128, rounded up to 32


def test_conv_states_equal_transformers_cache_after_decoding(checkpoint):
    """After a 13-token prefill and 5 one-token steps, each conv layer's state (its last 2
    inputs B * x) equals what transformers' cache holds for the same 18 tokens."""
    directory, hf = checkpoint("lfm2")
    rng = random.Random(4)
    ids = [rng.randrange(VOCAB) for _ in range(18)]
    served = Served(directory, TPB, pages=16)
    cache = served.manager.create_kv_cache(ids[:1])
    assert cache.resize(len(ids))
    pieces = [ids[:13]] + [[t] for t in ids[13:]]
    pos = 0
    for piece in pieces:
        served.engine.forward_logits([StepItem("s", cache, piece, pos, None)])
        cache.commit(piece)
        pos += len(piece)
    live = cache.live_state_page(1)
    store = served.manager.page_storage(1)
    with torch.inference_mode():
        out = hf(torch.tensor([ids[:13]]), use_cache=True)
        past = out.past_key_values
        for t in ids[13:]:
            past = hf(torch.tensor([[t]]), cache=past, use_cache=True).past_key_values
    for slot, layer in enumerate((0, 2)):
        theirs = past.get_conv_state(layer)[0]  # [channels, conv_L_cache]
        ours = store[live, slot].view(64, 2)
        torch.testing.assert_close(ours, theirs[:, -2:].float(), atol=1e-5, rtol=0)
    cache.close()


def _config(tmp_path, **changes):
    config = transformers.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, layer_types=["conv", "full_attention"])
    raw = {**config.to_dict(), "architectures": ["Lfm2ForCausalLM"], **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("changes, named", [
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"layer_types": ["conv", "mamba"]}, "layer_types"),
    ({"layer_types": ["conv"]}, "layer_types"),
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
     "rope_type 'dynamic'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_config_fields_it_cannot_serve_are_refused_by_name(tmp_path, changes, named):
    with pytest.raises(CheckpointError, match=named):
        read_config(_config(tmp_path, **changes))


def test_older_config_names_and_defaults(tmp_path):
    """``full_attn_idxs`` instead of ``layer_types``, ``block_ff_dim`` for the feed-forward
    size, ``tie_embedding``, and Lfm2Config's default theta of 1e6 when none is given."""
    raw = json.loads((_config(tmp_path) / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "intermediate_size", "tie_word_embeddings"):
        raw.pop(key, None)
    raw.update(full_attn_idxs=[1], block_ff_dim=192, tie_embedding=False,
               block_auto_adjust_ff_dim=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = read_config(tmp_path)
    assert args.layer_types == ("conv", "full_attention")
    assert (args.intermediate_size, args.tie_word_embeddings) == (192, False)
    assert args.rope.theta == 1_000_000.0
