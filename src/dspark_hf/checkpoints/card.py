"""Model cards for drafters shared on the Hub, and `push_to_hub` that writes one."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..models import DSparkDraftModel


@dataclass
class ModelCardInfo:
    """What a drafter's model card says beyond its config.

    `tau`: accepted length per dataset, e.g. `{"gsm8k": {"T=0": 6.1, "T=1": 5.9}}` or `{"gsm8k": 6.1}`;
    `calibration`: e.g. `{"method": "STS", "ece_before": [...], "ece_after": [...]}`; `training_data`: dataset names
    or a sentence; `training_budget`: e.g. "10 epochs, 8xH100, 30 h"; `extra`: more markdown appended at the end.
    """

    base_model: str
    repo_id: str | None = None
    tau: dict = field(default_factory=dict)
    calibration: dict | None = None
    training_data: str | list[str] | None = None
    training_budget: str | None = None
    license: str = "apache-2.0"
    extra: str | None = None


def _tau_table(tau: dict) -> str:
    if not tau:
        return "_Not measured yet._"
    columns = sorted({c for v in tau.values() if isinstance(v, dict) for c in v}) or ["τ"]
    lines = ["| dataset | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for dataset, values in tau.items():
        cells = [values.get(c, "") if isinstance(values, dict) else values for c in columns]
        lines.append(f"| {dataset} | " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def model_card(drafter: DSparkDraftModel, info: ModelCardInfo, layout: str = "native") -> str:
    """The README.md text (YAML front matter + usage snippet + τ table + calibration + training)."""
    config = drafter.config
    repo = info.repo_id or "<this repo>"
    kind = "DFlash" if config.is_dflash else "DSpark"
    data = info.training_data
    data = ", ".join(data) if isinstance(data, list) else data
    calibration = "_Uncalibrated (raw confidence head)._"
    if config.sts_temperatures:
        calibration = "Sequential Temperature Scaling, per-slot temperatures: " + ", ".join(
            f"{t:.3g}" for t in config.sts_temperatures)
    if info.calibration:
        calibration += "\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in info.calibration.items())
    serve = ""
    if layout == "deepspec":
        serve = (
            "\n## Serving\n\nThis repo is in DeepSpec's layout: vLLM (`--speculative-config "
            f"'{{\"method\": \"dspark\", \"model\": \"{repo}\", \"num_speculative_tokens\": {config.block_size}}}'`) "
            "and SGLang (`--speculative-algorithm DSPARK`) serve it directly.\n"
        )
    tags = ["dspark", "speculative-decoding", "dspark-hf", kind.lower()]
    return f"""---
library_name: dspark-hf
license: {info.license}
base_model: {info.base_model}
tags:
{chr(10).join(f"- {t}" for t in tags)}
---

# {kind} drafter for {info.base_model}

A {kind} block drafter ({config.num_hidden_layers} {config.backbone} layers, block size γ={config.block_size},
target layers {list(config.target_layer_ids)}, Markov rank {config.markov_rank}, confidence head
{"on" if config.enable_confidence_head else "off"}) for speculative decoding of `{info.base_model}`. Output is
lossless: exactly the target's distribution.

## Usage

```python
import dspark_hf
from transformers import AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{info.base_model}", dtype="auto", device_map="auto")
tokenizer = AutoTokenizer.from_pretrained("{info.base_model}")
drafter = dspark_hf.DSparkDraftModel.from_pretrained("{repo}").to(target.device)
inputs = tokenizer("Hello", return_tensors="pt").to(target.device)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
```

## Accepted length τ (accepted drafts + 1 bonus per round)

{_tau_table(info.tau)}

## Calibration

{calibration}

## Training

- Data: {data or "_not stated_"}
- Budget: {info.training_budget or "_not stated_"}
{serve}{info.extra or ""}
"""


def write_model_card(drafter: DSparkDraftModel, save_directory, info: ModelCardInfo, layout: str = "native") -> Path:
    path = Path(save_directory) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model_card(drafter, info, layout))
    return path


def push_to_hub(drafter: DSparkDraftModel, repo_id: str, info: ModelCardInfo, layout: str = "native",
                private: bool | None = None, token: str | None = None, commit_message: str = "Upload DSpark drafter"):
    """Saves `drafter` in `layout` with a model card and uploads the folder to `repo_id`."""
    from huggingface_hub import HfApi

    from .convert import save_as

    info.repo_id = info.repo_id or repo_id
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        save_as(drafter, folder, layout)
        write_model_card(drafter, folder, info, layout)
        return api.upload_folder(repo_id=repo_id, folder_path=os.fspath(folder), commit_message=commit_message)
