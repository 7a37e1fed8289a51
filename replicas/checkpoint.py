"""Load a local Hugging Face checkpoint directory into a ``replicas.models`` model.

    config.json                        -> the family's arguments (its ``parse_config``), validated
    model.safetensors                  -> weights, or
    model.safetensors.index.json       -> {"weight_map": {tensor name: shard file}}

The model is built on the meta device (no memory, no initialisation), then each tensor is
read from its safetensors file on its own, straight to the target device, converted to the
target dtype and put in place: host memory holds the model once plus one tensor in flight,
and nothing but that one tensor when loading to CUDA. Each file is opened (memory mapped)
per tensor so that pages already copied are unmapped, not kept resident. A bad directory
(missing file, unknown architecture, unsupported field, missing/unexpected/misshapen
tensor) raises ``CheckpointError`` naming what is wrong, before any server listens.

A family (a class of ``replicas.models.ARCHITECTURES``) says how its checkpoints map onto
its parameters:

- ``parse_config(raw, source)`` (classmethod): its arguments from ``config.json``; the
  result has ``architecture``, ``tie_word_embeddings`` and ``dtype``;
- ``IGNORED_TENSORS``: regular expressions of stored tensors it does not use (e.g. the
  multi-token-prediction layers of Qwen3-Next), which transformers drops too;
- ``checkpoint_tensor(param)`` (optional): ``(stored names, combine)`` for a parameter that
  is not stored under its own name: ``combine(*tensors)`` builds it from those tensors
  (a fused or split projection, MXFP4 blocks and scales, experts stored one by one stacked
  into one tensor: then one parameter's parts are in memory at once, besides the model).
  Default: ``((param,), None)``;
- ``TENSOR_ALIASES``: ``(pattern, replacement)`` pairs (``re`` syntax, whole names): where
  a stored name a parameter needs is not in the checkpoint, the first alias that maps it
  onto a name the checkpoint has is read instead (one family's checkpoints naming a
  tensor two ways, e.g. Kimi Linear's dense MLPs as transformers saves them);
- ``FLOAT32_PARAMETERS``: regular expressions of parameters kept in float32 whatever the
  model's dtype (what transformers keeps in float32, e.g. router weights and biases).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from replicas.models import ARCHITECTURES, CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that transformers ignores too.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_config(directory: str | Path):
    """The family's arguments of ``directory/config.json``."""
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
    return family(raw, str(path)).parse_config(raw, str(path))


def read_spec(directory: str | Path, dtype: str | torch.dtype | None = None):
    """The layer specs (``ModelSpec``) of ``directory``'s model, from its config alone:
    the model is built on the meta device (no memory, no weights read). For the sim engine,
    which keeps a model's pools and reuse rules without computing it. Raises
    ``CheckpointError``."""
    args = read_config(directory)
    with torch.device("meta"):
        model = ARCHITECTURES[args.architecture](args, _dtype(dtype))
    return model.spec, args


def family(raw: dict, source: str) -> type:
    """The model class of ``config.json``'s one ``architectures`` entry."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise CheckpointError(f"{source}: 'architectures' must list one architecture, "
                              f"got {archs!r}")
    if archs[0] not in ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {archs[0]!r} is not supported; "
                              f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[archs[0]]


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
    sources = _aliased(model, {name: _sources(model, name) for name in expected}, files)
    _check_names(directory, model, sources, files, args)
    device = torch.device(device)
    float32 = [re.compile(p) for p in getattr(model, "FLOAT32_PARAMETERS", ())]
    for name, (stored, combine) in sources.items():
        target = torch.float32 if any(p.fullmatch(name) for p in float32) else dtype
        if combine is None:
            tensor = _read(files[stored[0]], stored[0], expected[name].shape, target, device)
        else:
            tensor = _combined(files, name, stored, combine, expected[name].shape, target,
                               device)
        _set_parameter(model, name, tensor)
    model.tie_weights()
    model.to(device)  # the buffers (RoPE frequencies, computed at construction on the CPU)
    return model.eval().requires_grad_(False)


def _sources(model: nn.Module, name: str) -> tuple[tuple[str, ...], object]:
    hook = getattr(model, "checkpoint_tensor", None)
    return ((name,), None) if hook is None else hook(name)


def _aliased(model: nn.Module, sources: dict, files: dict[str, Path]) -> dict:
    """``sources`` with each stored name the checkpoint lacks replaced by the first of the
    family's ``TENSOR_ALIASES`` that it has (unchanged when none does: reported missing)."""
    aliases = [(re.compile(p), r) for p, r in getattr(model, "TENSOR_ALIASES", ())]
    if not aliases:
        return sources

    def stored_as(name: str) -> str:
        if name in files:
            return name
        for pattern, replacement in aliases:
            match = pattern.fullmatch(name)
            if match and (alias := match.expand(replacement)) in files:
                return alias
        return name

    return {param: (tuple(stored_as(s) for s in stored), combine)
            for param, (stored, combine) in sources.items()}


def _combined(files: dict[str, Path], name: str, stored: tuple[str, ...], combine,
              shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A parameter built from several stored tensors (read in their own dtype)."""
    parts = [_read(files[s], s, None, None, device) for s in stored]
    sources = ", ".join(stored) if len(stored) <= 4 else \
        f"{stored[0]} .. {stored[-1]} ({len(stored)} tensors)"
    try:
        tensor = combine(*parts)
    except (CheckpointError, RuntimeError, ValueError) as exc:  # e.g. misshapen experts
        raise CheckpointError(f"{files[stored[0]]}: {sources} cannot make {name}: {exc}"
                              ) from None
    del parts
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{files[stored[0]]}: {sources} make {name} of shape "
                              f"{list(tensor.shape)}, config.json implies {list(shape)}")
    return tensor.to(dtype)


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


def _check_names(directory: Path, model: nn.Module, sources: dict, files: dict[str, Path],
                 args) -> None:
    needed = list(dict.fromkeys(stored for names, _ in sources.values() for stored in names))
    missing = [name for name in needed if name not in files]
    if missing:
        raise CheckpointError(f"{directory}: tensor {missing[0]} is missing from the "
                              f"checkpoint ({len(missing)} missing) although config.json "
                              f"({args.architecture}) needs it")
    ignored = {"lm_head.weight"} if args.tie_word_embeddings else set()
    patterns = [re.compile(p) for p in getattr(model, "IGNORED_TENSORS", ())]
    known = set(needed)
    extra = [name for name in files if name not in known and name not in ignored
             and not name.endswith(_IGNORED_SUFFIXES)
             and not any(p.fullmatch(name) for p in patterns)]
    if extra:
        raise CheckpointError(f"{files[extra[0]]}: unexpected tensor {extra[0]} "
                              f"({len(extra)} unexpected): config.json ({args.architecture}"
                              ") describes a model without it (check attention_bias, "
                              "mlp_bias, num_hidden_layers, tie_word_embeddings)")


def _read(path: Path, name: str, shape: torch.Size | None, dtype: torch.dtype | None,
          device: torch.device) -> torch.Tensor:
    """One stored tensor, checked against ``shape`` and converted to ``dtype`` (None: as
    stored)."""
    with _open(path, device) as f:
        if name not in f.keys():
            raise CheckpointError(f"{path}: tensor {name} is missing (the index names it)")
        found = tuple(f.get_slice(name).get_shape())
        if shape is not None and found != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(found)}, config.json "
                                  f"implies {list(shape)}")
        tensor = f.get_tensor(name)
        # On the CPU, get_tensor may return a view of the file's mapping: copy it, so the
        # model owns its memory and never depends on the file again (a file rewritten or
        # truncated under a mapping reads garbage or raises SIGBUS).
        return tensor.to(dtype or tensor.dtype, copy=tensor.device.type == "cpu")


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
