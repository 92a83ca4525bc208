"""Training prompts for the SmolLM2 DSpark drafter: the first 2048 GSM8K *train* questions and 512 instructions
built from CPython-stdlib function docstrings (HumanEval and GSM8K test are never used). The target answers them
itself (`dspark-hf data generate`) before training (benchmarks/gpu_smollm2_run.sh).

    python benchmarks/smollm2_training_prompts.py OUT.jsonl
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from common import SHARED


def stdlib_instructions(count: int, seed: int = 0) -> list[str]:
    """'Write a Python function `name(args)`. <docstring>' for public stdlib functions with a short docstring."""
    items = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and not node.name.startswith("_") and 40 < len(doc) < 600:
                args = ", ".join(a.arg for a in node.args.args)
                items.append(f"Write a Python function `{node.name}({args})`. {doc.strip()}")
    random.Random(seed).shuffle(items)
    return items[:count]


def main() -> None:
    out = Path(sys.argv[1])
    with open(SHARED / "data" / "gsm8k" / "train.jsonl") as handle:
        prompts = [json.loads(line)["question"] for line, _ in zip(handle, range(2048))]
    prompts += stdlib_instructions(512)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
