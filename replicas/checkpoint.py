"""Load a local Hugging Face checkpoint directory into a ``replicas.models`` model.

    config.json                        -> ModelArgs (replicas/models/config.py), validated
    model.safetensors                  -> weights, or
    model.safetensors.index.json       -> {"weight_map": {tensor name: shard file}}

The model is built on the meta device (no memory, no initialisation), then each tensor is
read from its safetensors file on its own, straight to the target device, converted to the
target dtype and put in place: host memory holds the model once plus one tensor in flight,
and nothing but that one tensor when loading to CUDA. Each file is opened (memory mapped)
per tensor so that pages already copied are unmapped, not kept resident. A bad directory
(missing file, unknown architecture, unsupported field, missing/unexpected/misshapen
tensor) raises ``CheckpointError`` naming what is wrong, before any server listens.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from replicas.models import ARCHITECTURES, CheckpointError, ModelArgs, parse_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that transformers ignores too.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_config(directory: str | Path) -> ModelArgs:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint directory has "
                              "config.json)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return parse_config(raw, str(path))


def load_checkpoint(directory: str | Path, dtype: str | torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> nn.Module:
    """The model of ``directory`` on ``device`` in ``dtype`` (default float32), in eval
    mode, without gradients. Raises ``CheckpointError``."""
    directory = Path(directory)
    dtype = _dtype(dtype)
    args = read_config(directory)
    files = weight_files(directory)
    with torch.device("meta"):
        model = ARCHITECTURES[args.architecture](args, dtype)
    expected = dict(model.named_parameters())
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    _check_names(directory, expected, files, args)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in expected:
        by_file[files[name]].append(name)
    device = torch.device(device)
    for path, names in by_file.items():
        for name in names:
            _set_parameter(model, name, _read(path, name, expected[name].shape, dtype, device))
    model.tie_weights()
    model.to(device)  # the buffers (RoPE frequencies, computed at construction on the CPU)
    return model.eval().requires_grad_(False)


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: no readable 'weight_map' ({exc})") from None
        files = {name: directory / shard for name, shard in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index} names shard {path.name}, which is missing")
        return files
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                          "checkpoints are supported)")


def _check_names(directory: Path, expected: dict, files: dict[str, Path],
                 args: ModelArgs) -> None:
    missing = [name for name in expected if name not in files]
    if missing:
        raise CheckpointError(f"{directory}: tensor {missing[0]} is missing from the "
                              f"checkpoint ({len(missing)} missing) although config.json "
                              f"({args.architecture}) needs it")
    ignored = {"lm_head.weight"} if args.tie_word_embeddings else set()
    extra = [name for name in files if name not in expected and name not in ignored
             and not name.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise CheckpointError(f"{files[extra[0]]}: unexpected tensor {extra[0]} "
                              f"({len(extra)} unexpected): config.json ({args.architecture}"
                              ") describes a model without it (check attention_bias, "
                              "mlp_bias, num_hidden_layers, tie_word_embeddings)")


def _read(path: Path, name: str, shape: torch.Size, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    with _open(path, device) as f:
        if name not in f.keys():
            raise CheckpointError(f"{path}: tensor {name} is missing (the index names it)")
        found = tuple(f.get_slice(name).get_shape())
        if found != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(found)}, config.json "
                                  f"implies {list(shape)}")
        tensor = f.get_tensor(name)
        # On the CPU, get_tensor may return a view of the file's mapping: copy it, so the
        # model owns its memory and never depends on the file again (a file rewritten or
        # truncated under a mapping reads garbage or raises SIGBUS).
        return tensor.to(dtype, copy=tensor.device.type == "cpu")


def _open(path: Path, device: torch.device | str = "cpu"):
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype or torch.float32
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]
