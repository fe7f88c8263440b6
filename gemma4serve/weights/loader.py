"""Stream a safetensors checkpoint into a module, one tensor at a time.

The model module owns the naming: `to_param_name(checkpoint_name)` returns the parameter/buffer
name, or None for tensors the text engine does not use (vision/audio towers, the dead k/v weights
of KV-shared layers, ...). Everything is checked from the safetensors headers before a single
weight byte is read, so a wrong checkpoint fails in a second, not after minutes of copying, and the
error names every offending tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gemma4serve.parallel.shards import Shard

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class WeightLoadError(ValueError):
    pass


@dataclass(frozen=True)
class _Entry:
    file: Path
    name: str  # in the checkpoint
    param: str  # in the module
    nbytes: int
    shard: Shard | None  # the part this process loads (tensor parallelism); None: all of it


def _sharded_shape(shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    if shard is None:
        return shape
    out = list(shape)
    out[shard.dim] = sum(end - start for start, end in shard.ranges)
    return tuple(out)


def _read(reader, name: str, shard: Shard | None) -> torch.Tensor:
    """The tensor, or only its shard's ranges (read from the file, never the whole tensor)."""
    if shard is None:
        return reader.get_tensor(name)
    tensor = reader.get_slice(name)
    lead = (slice(None),) * shard.dim
    parts = [tensor[(*lead, slice(start, end))] for start, end in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)


def checkpoint_files(ckpt_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint.

    These are the shards of `model.safetensors.index.json`, else the single file.
    """
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (ckpt_dir / f).exists()]
        if missing:
            raise WeightLoadError(f"{index} names shard files that are not there: {missing}")
        return [ckpt_dir / f for f in files]
    single = ckpt_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise WeightLoadError(f"no model.safetensors or model.safetensors.index.json in {ckpt_dir}")


def _short_list(items: list[str], limit: int = 20) -> str:
    more = f" ... (+{len(items) - limit} more)" if len(items) > limit else ""
    return "\n  " + "\n  ".join(items[:limit]) + more


def _safetensors_device(device: torch.device) -> str | int:
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    return str(device)


def load_weights(
    module: torch.nn.Module,
    ckpt_dir: str | Path,
    *,
    to_param_name: Callable[[str], str | None],
    device: str | torch.device,
    dtype: torch.dtype | None,
    progress: bool = True,
    shard_of: Callable[[str, tuple[int, ...]], Shard | None] | None = None,
) -> None:
    """Copy each checkpoint tensor that `to_param_name` maps into the module's tensor of that name.

    Floating tensors are converted to `dtype` (None: the parameter's own dtype); integer tensors
    (e.g. the assistant's `token_ordering`) keep theirs. Raises WeightLoadError, naming the
    tensors, for names the module does not have, shape mismatches, a parameter loaded twice, and
    parameters left unloaded (except those in `module.optional_weights`).

    `shard_of(param, checkpoint shape)`: under tensor parallelism, the part of a tensor this rank
    loads (None: all of it); the module's tensors have the shard's shape.
    """
    device = torch.device(device)
    # Persistent parameters and buffers, by name (tied ones twice).
    targets = module.state_dict(keep_vars=True)
    optional = set(getattr(module, "optional_weights", ()))

    # Pass 1: headers only.
    entries: list[_Entry] = []
    unknown, mismatched, twice = [], [], []
    loaded_by: dict[str, str] = {}
    for file in checkpoint_files(ckpt_dir):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                param_name = to_param_name(name)
                if param_name is None:
                    continue
                if param_name not in targets:
                    unknown.append(f"{name} -> {param_name}" if param_name != name else name)
                    continue
                header = reader.get_slice(name)
                shape = tuple(header.get_shape())
                expected = tuple(targets[param_name].shape)
                shard = shard_of(param_name, shape) if shard_of is not None else None
                loaded_shape = _sharded_shape(shape, shard)
                if loaded_shape != expected:
                    mismatched.append(
                        f"{name}: checkpoint {list(shape)}"
                        + (f" (shard {list(loaded_shape)})" if shard else "")
                        + f", module {param_name} expects {list(expected)}"
                    )
                    continue
                if param_name in loaded_by:
                    twice.append(f"{param_name} <- {loaded_by[param_name]} and {name}")
                    continue
                loaded_by[param_name] = name
                dtype_name = header.get_dtype()
                itemsize = _DTYPES[dtype_name].itemsize if dtype_name in _DTYPES else 1
                nbytes = itemsize * _numel(loaded_shape)
                entries.append(_Entry(file, name, param_name, nbytes, shard))

    # Tied parameters appear under several names; loading any of them loads the tensor.
    loaded_tensors = {id(targets[param]) for param in loaded_by}
    missing = [
        name
        for name, tensor in targets.items()
        if id(tensor) not in loaded_tensors and name not in optional
    ]
    on_meta = [param for param in loaded_by if targets[param].is_meta]
    problems = []
    if on_meta:
        problems.append(
            f"{len(on_meta)} module weight(s) are on the meta device "
            "(materialize the module first, e.g. module.to_empty(device=...)):"
            + _short_list(on_meta)
        )
    if unknown:
        problems.append(
            f"{len(unknown)} checkpoint tensor(s) map to names the module does not have:"
            + _short_list(unknown)
        )
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es):" + _short_list(mismatched))
    if twice:
        problems.append(
            f"{len(twice)} parameter(s) loaded from two checkpoint tensors:" + _short_list(twice)
        )
    if missing:
        problems.append(
            f"{len(missing)} module weight(s) missing from the checkpoint:" + _short_list(missing)
        )
    if problems:
        raise WeightLoadError(f"cannot load {ckpt_dir}:\n" + "\n".join(problems))

    # Pass 2: stream, file by file, tensor by tensor.
    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(entry.nbytes for entry in entries), unit="B", unit_scale=True, unit_divisor=1024,
        desc="Loading weights", disable=not progress,
    )  # fmt: skip
    st_device = _safetensors_device(device)
    try:
        by_file: dict[Path, list[_Entry]] = {}
        for entry in entries:
            by_file.setdefault(entry.file, []).append(entry)
        with torch.no_grad():
            for file, file_entries in by_file.items():
                with safe_open(str(file), framework="pt", device=st_device) as reader:
                    for entry in file_entries:
                        tensor = _read(reader, entry.name, entry.shard)
                        target = targets[entry.param]
                        if tensor.is_floating_point():
                            tensor = tensor.to(dtype or target.dtype)
                        target.copy_(tensor)
                        del tensor
                        bar.update(entry.nbytes)
    finally:
        bar.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
