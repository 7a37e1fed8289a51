"""Checkpoint directories: sharded and single-file load the same weights, dtypes are
honoured, and each bad directory gets one CheckpointError naming what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replicas.checkpoint import load_checkpoint
from replicas.engines import make_engine
from replicas.engines.torch_engine import TorchEngine
from replicas.models import ARCHITECTURES, CheckpointError, RopeConfig, parse_config
from replicas.models.config import ARCHITECTURE_RULES
from replicas.settings import ReplicaSettings
from tests.replicas.models.checkpoints import save_checkpoint

SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(variant)``: a checkpoint directory saved once per module."""
    dirs = {}

    def get(variant: str, **save_kwargs) -> Path:
        key = (variant, tuple(sorted(save_kwargs.items())))
        if key not in dirs:
            dirs[key] = tmp_path_factory.mktemp(variant)
            save_checkpoint(variant, dirs[key], **save_kwargs)
        return dirs[key]

    return get


def test_every_architecture_has_its_config_rules():
    """config.py's shared rules are the Llama-like families'; every other family parses its
    own config.json (its parse_config)."""
    assert sorted(ARCHITECTURE_RULES) == [
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    assert set(ARCHITECTURE_RULES) <= set(ARCHITECTURES)
    assert all(callable(getattr(cls, "parse_config", None)) for cls in ARCHITECTURES.values())


def test_a_sharded_checkpoint_loads_the_same_weights(saved):
    single, sharded = saved("qwen3"), saved("qwen3", max_shard_size="100KB")
    assert not (single / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) >= 3
    a, b = load_checkpoint(single), load_checkpoint(sharded)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_tied_embeddings_share_one_tensor(saved):
    model = load_checkpoint(saved("qwen2"))  # tie_word_embeddings: lm_head is not saved
    assert "lm_head.weight" not in load_file(saved("qwen2") / SINGLE)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_dtype_reaches_weights_and_pages(saved, dtype):
    engine = TorchEngine.from_checkpoint(saved("qwen3"), dtype=dtype, device="cpu")
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, dtype)}
    engine.cache_config(8, 8, True)
    assert {layout.dtype for layout in engine.page_layouts()} == {dtype}
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert engine.describe()["dtype"] == dtype


def test_rope_fields_old_and_new():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 64}
    assert parse_config(base).rope == RopeConfig("default", 10000.0,
                                                 original_max_position_embeddings=64)
    old = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert parse_config(old).rope == RopeConfig("linear", 5e5, 2.0,
                                                original_max_position_embeddings=64)
    new = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8,
                                       "low_freq_factor": 1, "high_freq_factor": 4,
                                       "original_max_position_embeddings": 8192}}
    assert parse_config(new).rope == RopeConfig("llama3", 5e5, 8.0, 1.0, 4.0, 8192)


def test_make_engine_builds_the_checkpoint(saved):
    engine = make_engine(ReplicaSettings(engine="torch", model=str(saved("mistral")),
                                         device="cpu"))
    info = engine.describe()
    assert (info["architecture"], info["windows"], info["layers"]) == (
        "MistralForCausalLM", [12], ["sliding", "sliding"])


# -- bad directories ---------------------------------------------------------------------

def _edit_config(**changes):
    def edit(directory: Path) -> None:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is _DELETE:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    return edit


def _edit_tensors(edit_dict):
    def edit(directory: Path) -> None:
        tensors = load_file(directory / SINGLE)
        edit_dict(tensors)
        save_file(tensors, directory / SINGLE, metadata={"format": "pt"})
    return edit


def _remove(name: str):
    return lambda directory: (directory / name).unlink()


def _write(name: str, text: str):
    return lambda directory: (directory / name).write_text(text)


_DELETE = object()
K_PROJ = "model.layers.0.self_attn.k_proj.weight"

BAD = {
    # name: (variant, edit, the error's words)
    "unknown architecture": ("llama", _edit_config(architectures=["GPT2LMHeadModel"]),
                             "architecture 'GPT2LMHeadModel' is not supported"),
    "no architectures": ("llama", _edit_config(architectures=_DELETE),
                         "'architectures' must list one architecture"),
    "missing config.json": ("llama", _remove("config.json"), "config.json: missing"),
    "config.json not JSON": ("llama", _write("config.json", "{"), "cannot be read as JSON"),
    "missing field": ("llama", _edit_config(vocab_size=_DELETE), "missing field 'vocab_size'"),
    "missing safetensors": ("llama", _remove(SINGLE),
                            "no model.safetensors or model.safetensors.index.json"),
    "not safetensors": ("llama", _write(SINGLE, "not a tensor file"),
                        "model.safetensors: not a readable safetensors file"),
    "wrong shape": ("llama", _edit_tensors(lambda t: t.update({K_PROJ: t[K_PROJ][:16]})),
                    f"tensor {K_PROJ} has shape [16, 64], config.json implies [32, 64]"),
    "missing tensor": ("llama", _edit_tensors(lambda t: t.pop("model.norm.weight")),
                       "tensor model.norm.weight is missing from the checkpoint"),
    "config says biases the file lacks": (
        "llama", _edit_config(attention_bias=True),
        "tensor model.layers.0.self_attn.q_proj.bias is missing"),
    "unexpected tensor": (
        "qwen2", _edit_tensors(lambda t: t.update(
            {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})),
        "unexpected tensor model.layers.0.self_attn.o_proj.bias"),
    "unknown rope type": ("llama", _edit_config(rope_parameters={"rope_type": "yarn",
                                                                 "factor": 4.0}),
                          "rope_type 'yarn' is not supported; supported: default, linear"),
    "old unknown rope type": ("llama", _edit_config(rope_scaling={"type": "dynamic",
                                                                  "factor": 2.0}),
                              "rope_scaling: rope_type 'dynamic' is not supported"),
    "llama3 rope incomplete": ("llama", _edit_config(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        "rope_type 'llama3' needs low_freq_factor"),
    "partial rotary": ("llama", _edit_config(partial_rotary_factor=0.5),
                       "partial_rotary_factor 0.5"),
    "attention_bias on Mistral": ("mistral", _edit_config(attention_bias=True),
                                  "attention_bias=True: MistralForCausalLM does not take"),
    "mlp_bias on Qwen3": ("qwen3", _edit_config(mlp_bias=True),
                          "mlp_bias=True: Qwen3ForCausalLM does not take"),
    "sliding_window on Llama": ("llama", _edit_config(sliding_window=16),
                                "sliding_window=16: LlamaForCausalLM does not take"),
    "activation": ("llama", _edit_config(hidden_act="gelu"), "hidden_act='gelu'"),
    "quantized": ("llama", _edit_config(quantization_config={"quant_method": "gptq"}),
                  "quantized checkpoints are not supported"),
    "sliding layers without a window": (
        "qwen3", _edit_config(use_sliding_window=False),
        "names sliding_attention layers but no sliding_window is set"),
    "unknown layer type": ("qwen3", _edit_config(layer_types=["full_attention", "chunked",
                                                              "full_attention",
                                                              "full_attention"]),
                           "layer_types=["),
    "layer_types of the wrong length": (
        "qwen3", _edit_config(layer_types=["full_attention"] * 3),
        "layer_types has 3 entries for 4 layers"),
    "heads not a multiple of kv heads": ("llama", _edit_config(num_key_value_heads=3),
                                         "num_attention_heads 4 is not a multiple of "
                                         "num_key_value_heads 3"),
    "bad field type": ("llama", _edit_config(hidden_size="64"),
                       "hidden_size='64': must be a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_directory_gets_one_error_naming_what_is_wrong(saved, tmp_path, case):
    variant, edit, words = BAD[case]
    directory = tmp_path / "model"
    shutil.copytree(saved(variant), directory)
    edit(directory)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_a_sharded_checkpoint_missing_a_shard(saved, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(saved("qwen3", max_shard_size="100KB"), directory)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names shard {shard.name}, which is missing"):
        load_checkpoint(directory)


def test_not_a_directory_and_a_bad_dtype(tmp_path, saved):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="dtype 'int8' is not supported"):
        load_checkpoint(saved("llama"), dtype="int8")


def test_python_m_replicas_refuses_a_bad_checkpoint_before_listening(saved, tmp_path, capsys):
    from replicas.__main__ import main
    from tests.replicas import hf_checkpoints

    directory = tmp_path / "model"
    shutil.copytree(saved("llama"), directory)
    hf_checkpoints.llama3(directory)  # its tokenizer loads; the model does not
    _edit_config(architectures=["GPT2LMHeadModel"])(directory)
    assert main(["--engine", "torch", "--model", str(directory), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "architecture 'GPT2LMHeadModel' is not supported" in err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_listening(tmp_path):
    """A checkpoint whose tokenizer.json has more ids than its embedding: python -m replicas
    names both sizes and exits 2 (serving it would fail on the first such id)."""
    from tests.replicas.hf_checkpoints import llama3
    from tests.replicas.models.checkpoints import VOCAB, save_checkpoint

    llama3(tmp_path)
    save_checkpoint("llama", tmp_path)
    from text import load_tokenizer

    size = load_tokenizer(str(tmp_path)).vocab_size
    assert size > VOCAB
    out = subprocess.run([sys.executable, "-m", "replicas", "--engine", "torch", "--model",
                          str(tmp_path), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert (f"the tokenizer has {size} token ids but the model embeds only {VOCAB}"
            in out.stderr)
