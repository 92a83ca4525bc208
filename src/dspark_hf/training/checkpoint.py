"""Training checkpoints without pickle: the drafter via `save_pretrained` (float32), the optimizer's tensors in
`optimizer.safetensors`, and every scalar (step, AdamW step counts, hyper-parameters, config) in `trainer_state.json`.

Layout of `output_dir/checkpoints/step-XXXXXXX/`: `config.json`, `model.safetensors`, `optimizer.safetensors`,
`trainer_state.json`. `latest_checkpoint(output_dir)` finds the newest complete one (`trainer_state.json` is written
last).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step-{step:07d}")


def latest_checkpoint(output_dir: str) -> str | None:
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        match = re.fullmatch(r"step-(\d+)", name)
        if match and os.path.exists(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return max(found)[1] if found else None


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """AdamW-style state -> ({"<param>.<key>": tensor}, {"<param>": {"<key>": scalar}}); `names` follow the param order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(names):
        raise RuntimeError("Optimizer parameters and names disagree.")
    tensors, scalars = {}, {}
    for name, param in zip(names, params):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and key != "step":
                tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = float(value)
    return tensors, scalars


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict, scalars: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, param in zip(names, params):
        state = {}
        for key, value in scalars.get(name, {}).items():
            state[key] = torch.tensor(value, dtype=torch.float32)
        prefix = name + "."
        for key, value in tensors.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                state[key[len(prefix):]] = value.to(param.device)
        if state:
            optimizer.state[param] = state


def save_checkpoint(path: str, drafter, optimizer, param_names: list[str], state: dict) -> None:
    """Writes a complete checkpoint (atomically: into a temporary folder, then renamed)."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    drafter.save_pretrained(tmp)
    tensors, scalars = optimizer_to_tensors(optimizer, param_names)
    save_file(tensors, os.path.join(tmp, OPTIMIZER_FILE))
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump({**state, "optimizer_scalars": scalars,
                   "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]},
                  f, indent=1, default=list)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_training_state(path: str) -> tuple[dict, dict]:
    """(trainer_state.json content, optimizer tensors)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    return state, load_file(os.path.join(path, OPTIMIZER_FILE))
