"""A trainer's state as files that any number of ranks resume: rank 0 writes it whole, each reads its part.

What it holds: for each parameter the trainer trains (frozen ones are the input model's and never change),
its fp32 weight and AdamW's two moments, plus the optimizer's step count. Gathered from wherever they live: a
plain torch optimizer's per-parameter state (PlainTorchTrainer, DeepSpeed without ZeRO in fp32, where every
rank holds the same full state), or ZeRO's partitions and bf16 master weights, reassembled one parameter at a
time with DeepSpeed's `safe_get_full_*` collectives. Loading goes the other way: rank 0 reads each tensor and
broadcasts it, and every rank keeps its part (`safe_set_full_*`), so a state written by 2 ranks under ZeRO-2
resumes on 1 rank under the plain trainer, or on 4.

Why not DeepSpeed's `save_checkpoint`: it writes one optimizer file per rank into a folder every rank must
reach (a shared file system across nodes), cut for that rank count; and its files are pickles. Here only
rank 0 writes, nothing depends on the rank count, and the files are safetensors and JSON: nothing is
unpickled on load.

Files, in the folder given: `trainer_state.json` (format, step count, tensor names, shard files) and
`trainer_state-NNNNN.safetensors` shards of at most SHARD_BYTES, so rank 0 never holds more than one shard
and one parameter in memory. What it is not: a model checkpoint (policy/ and critic/ are the HF-format
outputs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from alignflow.stages.common.ranks import from_main, is_main, world_size

FORMAT = "alignflow-trainer-state-1"
INDEX_FILE = "trainer_state.json"
SHARD_BYTES = 2 << 30
MOMENTS = ("exp_avg", "exp_avg_sq")


class TrainerStateError(ValueError):
    """A saved trainer state that does not fit the trainer resuming it."""


def _trainable(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in trainer.module.named_parameters() if p.requires_grad]


def _optimizer(trainer):
    """The optimizer object the trainer steps: PlainTorchTrainer's AdamW, or a DeepSpeed engine's (its torch
    optimizer without ZeRO in fp32, else ZeRO's or the bf16 wrapper)."""
    return trainer.optimizer


def _sharded(trainer) -> bool:
    """Whether the weights the optimizer updates live apart from the module's parameters (ZeRO partitions,
    bf16 masters): then only DeepSpeed's collectives see them whole."""
    return any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for _, p in _trainable(trainer))


def _base_optimizer(trainer) -> torch.optim.Optimizer:
    """The torch optimizer that holds the moments: ZeRO's wraps one over its flat fp32 partitions."""
    wrapper = _optimizer(trainer)
    return wrapper.optimizer if _sharded(trainer) else wrapper


def _link_sharded_moments(trainer) -> None:
    """Give ZeRO's flat partitions their AdamW state before the first step (torch creates it lazily, and
    DeepSpeed maps each parameter's fragment of it only after a step): zero moments, step 0, which is what
    the first step would create, and then the mapping DeepSpeed makes after its first step."""
    wrapper = _optimizer(trainer)
    base = wrapper.optimizer
    zero3 = hasattr(wrapper, "fp32_partitioned_groups_flat")  # ZeRO-3 reads its flat groups' state directly
    if not zero3 and getattr(wrapper, "_hp_optimizer_states_linked", True):
        return
    flats = wrapper.fp32_partitioned_groups_flat if zero3 else [
        flat for group in base.param_groups for flat in group["params"]]
    for flat in flats:
        base.state.setdefault(flat, {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                     "exp_avg_sq": torch.zeros_like(flat)})
    if not zero3:
        wrapper._lazy_init_hp_params_optimizer_state()


def _steps(trainer) -> int:
    states = _base_optimizer(trainer).state.values()
    return max((int(state["step"]) for state in states if "step" in state), default=0)


def _full_tensors(trainer) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(key, tensor) of every saved tensor in a fixed order, on CPU: `weight.<name>`, `exp_avg.<name>`,
    `exp_avg_sq.<name>`. Every rank must iterate it (the sharded case gathers with a collective per tensor);
    only rank 0's tensors are real, the others get None."""
    if _sharded(trainer):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        _link_sharded_moments(trainer)
        for name, param in _trainable(trainer):
            yield f"weight.{name}", _on_main(safe_get_full_fp32_param(param))
            for moment in MOMENTS:
                yield f"{moment}.{name}", _on_main(safe_get_full_optimizer_state(param, moment))
        return
    state = _optimizer(trainer).state
    for name, param in _trainable(trainer):
        yield f"weight.{name}", _on_main(param.detach())
        for moment in MOMENTS:
            value = state.get(param, {}).get(moment)
            yield f"{moment}.{name}", _on_main(torch.zeros_like(param) if value is None else value)


def _on_main(tensor: torch.Tensor) -> torch.Tensor | None:
    return tensor.detach().to("cpu", copy=True).contiguous() if is_main() else None


def save_trainer_state(trainer, folder: Path) -> None:
    """Write the trainer's state into `folder` (rank 0; every rank must call it: gathering is collective)."""
    from safetensors.torch import save_file

    steps = _steps(trainer)
    shard: dict[str, torch.Tensor] = {}
    files: dict[str, str] = {}
    number, size = 1, 0
    for key, tensor in _full_tensors(trainer):
        if tensor is None:
            continue
        if size and size + tensor.nbytes > SHARD_BYTES:
            _write_shard(folder, number, shard, save_file)
            number, size = number + 1, 0
        shard[key] = tensor
        files[key] = _shard_name(number)
        size += tensor.nbytes
    if not is_main():
        return
    _write_shard(folder, number, shard, save_file)
    index = {"format": FORMAT, "optimizer_steps": steps, "written_by_ranks": world_size(), "tensors": files}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")


def _shard_name(number: int) -> str:
    return f"trainer_state-{number:05d}.safetensors"


def _write_shard(folder: Path, number: int, tensors: dict[str, torch.Tensor], save_file) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _shard_name(number)))
    tensors.clear()


def read_index(folder: Path, where: str) -> dict[str, Any]:
    """The state's index, checked: a clear error naming `where` for a missing or foreign one."""
    path = folder / INDEX_FILE
    if not path.is_file():
        raise TrainerStateError(f"{where}: no {INDEX_FILE}; this checkpoint was not written by this "
                                "version's RL stage; start a fresh run (another output)")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise TrainerStateError(f"{where}/{INDEX_FILE}: format {index.get('format')!r}, expected {FORMAT!r}; "
                                "start a fresh run (another output)")
    return index


def load_trainer_state(trainer, folder: Path | None, where: str) -> None:
    """Resume `trainer` from the state rank 0 reads in `folder` (the other ranks pass None: rank 0 broadcasts
    every tensor). `where` names the state in errors. Every rank must call it."""
    index = from_main(read_index(folder, where) if is_main() else None)
    trainable = _trainable(trainer)
    saved = {key.split(".", 1)[1] for key in index["tensors"] if key.startswith("weight.")}
    names = {name for name, _ in trainable}
    if saved != names:
        missing, extra = sorted(names - saved), sorted(saved - names)
        raise TrainerStateError(
            f"{where}: the saved state trains other parameters than this model does (missing: "
            f"{', '.join(missing[:3]) or 'none'}; not in the model: {', '.join(extra[:3]) or 'none'}); "
            "resume with the ppo/lora settings that wrote it, or start a fresh run (another output)")
    opened: dict[str, Any] = {}

    def read(key: str) -> torch.Tensor | None:
        if not is_main():
            return None
        from safetensors import safe_open

        file = index["tensors"][key]
        if file not in opened:
            opened[file] = safe_open(folder / file, "pt")
        return opened[file].get_tensor(key)

    sharded = _sharded(trainer)
    if sharded:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        _link_sharded_moments(trainer)
    torch_state: dict[int, dict[str, torch.Tensor]] = {}
    in_order = (p for group in _optimizer(trainer).param_groups for p in group["params"])
    position = {id(p): i for i, p in enumerate(in_order)}
    for name, param in trainable:
        weight = _broadcast(read(f"weight.{name}"), param)
        moments = {m: _broadcast(read(f"{m}.{name}"), param) for m in MOMENTS}
        with torch.no_grad():
            _set_module_weight(param, weight)
        if sharded:
            safe_set_full_fp32_param(param, weight)
            for moment, value in moments.items():
                safe_set_full_optimizer_state(param, value, moment)
        else:
            torch_state[position[id(param)]] = {"step": torch.tensor(float(index["optimizer_steps"])),
                                                **moments}
    steps = float(index["optimizer_steps"])
    if sharded:
        for state in _base_optimizer(trainer).state.values():
            state["step"] = torch.tensor(steps)
    elif steps > 0:  # before the first step torch's AdamW has no state: leave it so
        optimizer = _optimizer(trainer)
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
    if hasattr(trainer, "global_steps"):  # DeepSpeed's counters, which its schedules and logging read
        trainer.global_steps = int(steps)
        trainer.global_samples = int(steps) * trainer.train_batch_size()


def _set_module_weight(param: torch.nn.Parameter, weight: torch.Tensor) -> None:
    if hasattr(param, "ds_id"):  # ZeRO-3: the module holds a partition; gather, set, re-partition
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if is_main():
                param.data.copy_(weight.view_as(param))
        return
    param.data.copy_(weight.view_as(param))


def _broadcast(tensor: torch.Tensor | None, like: torch.nn.Parameter) -> torch.Tensor:
    """Rank 0's tensor on every rank, fp32, on `like`'s device (no collective on one rank)."""
    full_shape = like.ds_shape if hasattr(like, "ds_shape") else like.shape
    if world_size() == 1:
        assert tensor is not None
        return tensor.to(like.device, torch.float32).view(full_shape)
    box = (tensor.to(torch.float32) if is_main() else torch.empty(full_shape, dtype=torch.float32))
    box = box.to(like.device).contiguous()
    torch.distributed.broadcast(box, src=0)
    return box.view(full_shape)

