#!/usr/bin/env python3
"""Share a drafter on the Hugging Face Hub: save it (safetensors + config + model card), then upload.

    python examples/push_to_hub.py --repo-id you/dspark-my-model [--drafter FOLDER] [--base-model ID] [--output DIR]

Offline-safe: the folder is always written with `save_pretrained` and a model card; the upload happens only when a
token is available (`HF_TOKEN` or `huggingface-cli login`), the Hub is reachable, `HF_HUB_OFFLINE` is unset, and
`--repo-id` is given. Otherwise the script prints what `push_to_hub` would do. Loading it back needs no
`trust_remote_code`: `DSparkDraftModel.from_pretrained("you/dspark-my-model")`.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import dspark_hf
from dspark_hf.demo import load_demo_pair


def hub_ready() -> tuple[bool, str]:
    """Whether an upload can happen, and why not."""
    if os.environ.get("HF_HUB_OFFLINE"):
        return False, "HF_HUB_OFFLINE is set"
    from huggingface_hub import get_token

    if not get_token():
        return False, "no Hugging Face token (set HF_TOKEN or run `huggingface-cli login`)"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=2).close()
    except OSError:
        return False, "the Hub is not reachable from this machine"
    return True, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", help="a trained drafter folder (default: the demo pair's drafter)")
    parser.add_argument("--base-model", help="the target the drafter was trained for (default: the demo pair's)")
    parser.add_argument("--repo-id", help="where to upload, e.g. you/dspark-my-model")
    parser.add_argument("--layout", default="native", help="native, or deepspec for vLLM/SGLang")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--output", help="where to save the folder (default: a temporary folder)")
    args = parser.parse_args()

    if args.drafter:
        drafter = dspark_hf.DSparkDraftModel.from_pretrained(args.drafter)
        base_model = args.base_model or "your-org/your-target"
    else:
        pair = load_demo_pair()
        drafter = pair.drafter
        base_model = args.base_model or (pair.target.name_or_path if pair.trained else "your-org/your-target")
    output = Path(args.output or tempfile.mkdtemp(prefix="dspark-drafter-"))

    # 1. save: safetensors only; the embedding / LM head shared with the target are left out
    drafter.save_pretrained(output)
    try:
        from dspark_hf.checkpoints import ModelCardInfo, push_to_hub, write_model_card
    except ImportError:  # an older dspark_hf without model cards
        ModelCardInfo = None
    info = None
    if ModelCardInfo is not None:
        info = ModelCardInfo(base_model=base_model, repo_id=args.repo_id,
                             training_data="say what it was trained on", training_budget="say how long, on what")
        write_model_card(drafter, output, info)
    files = sorted(p.name for p in output.iterdir())
    print(f"saved {output}: {', '.join(files)}")

    # 2. check it loads back
    reloaded = dspark_hf.DSparkDraftModel.from_pretrained(output)
    assert reloaded.config.block_size == drafter.config.block_size
    print(f"reloads: block_size {reloaded.config.block_size}, target layers {reloaded.config.target_layer_ids}")

    # 3. upload, or say what would happen
    ready, why = hub_ready()
    if args.repo_id and ready:
        if info is not None:
            push_to_hub(drafter, args.repo_id, info, layout=args.layout, private=args.private or None)
        else:
            drafter.push_to_hub(args.repo_id, private=args.private or None)
        print(f"uploaded to https://huggingface.co/{args.repo_id}")
        return
    repo = args.repo_id or "<your-name>/<drafter-name>"
    print(f"not uploading: {why if not ready else 'no --repo-id given'}. With a token and the network this would run:")
    if info is not None:
        print(f"  dspark_hf.checkpoints.push_to_hub(drafter, {repo!r}, ModelCardInfo(base_model={base_model!r}, ...), "
              f"layout={args.layout!r})")
        print(f"  -> create_repo({repo!r}, exist_ok=True) and upload_folder() of: {', '.join(files)}")
    else:
        print(f"  drafter.push_to_hub({repo!r})")
    print(f"  then anyone loads it with: dspark_hf.DSparkDraftModel.from_pretrained({repo!r})")


if __name__ == "__main__":
    main()
