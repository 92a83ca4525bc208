"""Train a DSpark and a DFlash drafter for the 50M code fixture with the same budget and data; measure τ.

Two phases:

- `train` (GPU machine, 2 GPUs): materialise the fixture target (bf16), tokenize the Python corpus (1024-token chunks),
  calibrate the step time of the DSpark recipe, then train DSpark on GPU 0 and DFlash on GPU 1 *concurrently* with the
  same number of steps, data order and anchors; a quick bf16 τ check on held-out prompts; writes under --out.
- `evaluate` (any machine, float32): τ at temperature 0 and 1.0 on held-out code prompts (γ = 7) for the two trained
  drafters and the 10M classic assistant (HF assisted generation, num_assistant_tokens=7, constant schedule); writes
  `benchmarks/results/train_code50m.json` and the position-wise conditional acceptance plot.

    python benchmarks/train_code50m.py train --fixture carry/code-llama-50m --corpus carry/corpus46.txt.xz \
        --holdout carry/holdout.txt.xz --out $OUT --budget-s 140
    python benchmarks/train_code50m.py evaluate --gpu-results RESULTS.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import accelerate

        out["accelerate"] = accelerate.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["num_gpus"] = torch.cuda.device_count()
    return out


def materialize_fixture(fixture: str, work: str, materializer: str) -> str:
    """Turns the int8 fixture (tokenizer.json possibly xz-compressed) into an HF folder (bf16)."""
    src = os.path.join(work, "fixture")
    shutil.copytree(fixture, src, dirs_exist_ok=True)
    packed = os.path.join(src, "tokenizer.json.xz")
    if os.path.exists(packed):
        with lzma.open(packed) as f, open(os.path.join(src, "tokenizer.json"), "wb") as g:
            g.write(f.read())
    out = os.path.join(work, "target")
    subprocess.run([sys.executable, materializer, src, out, "--dtype", "bfloat16"], check=True)
    return out


def holdout_prompts(tokenizer, path: str, count: int, prompt_tokens: int = 128, min_tokens: int = 320):
    from dspark_hf.training.data import read_documents

    prompts = []
    for doc in read_documents(path):
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            prompts.append(torch.tensor(ids[:prompt_tokens]))
        if len(prompts) == count:
            break
    return prompts


# ---------------------------------------------------------------------------------------------- GPU phase
def worker(args) -> None:
    """One training run (a child process on one GPU)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_hf.training import TokenizedDataset, preset
    from dspark_hf.training.trainer import DrafterTrainer

    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    chunks = load_file(args.tokens)["input_ids"].long()
    ones = torch.ones(chunks.shape[1], dtype=torch.uint8)
    dataset = TokenizedDataset(list(chunks.unbind(0)), [ones] * chunks.shape[0])
    overrides = {"logging_steps": args.logging_steps, **json.loads(args.overrides)}
    config = preset(f"code50m-{args.mode}", max_steps=args.steps, compile=args.compile,
                    attn_implementation=args.attn, **overrides)
    trainer = DrafterTrainer(target, tokenizer, dataset, config, args.output, resume=False, progress=False)
    if args.calibrate:
        times = []
        for _ in range(args.steps):
            sync()
            started = time.perf_counter()
            trainer.train_step()
            sync()
            times.append(time.perf_counter() - started)
        steady = sorted(times[len(times) // 2 :])[len(times[len(times) // 2 :]) // 2]
        result = {"step_times": times, "steady_step_s": steady}
    else:
        result = trainer.train()
        result["history"] = trainer.history
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    with open(os.path.join(args.output, "worker_result.json"), "w") as f:
        json.dump(result, f, indent=1)


def run_worker(mode: str, gpu: int, output: str, extra: list[str], common: list[str]) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    log = open(output + ".log", "w")
    os.makedirs(output, exist_ok=True)
    return subprocess.Popen([sys.executable, __file__, "_worker", "--mode", mode, "--output", output, *common, *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def train_phase(args) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_hf.training import text_dataset
    from dspark_hf.training.data import read_documents

    started = time.time()
    work = args.work
    os.makedirs(work, exist_ok=True)
    target_dir = materialize_fixture(args.fixture, work, args.materializer)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    t0 = time.time()
    max_length = json.loads(args.overrides).get("max_length", 1024)
    dataset = text_dataset(tokenizer, read_documents(args.corpus), max_length)
    tokens_path = os.path.join(work, "tokens.safetensors")
    save_file({"input_ids": torch.stack(dataset.input_ids).to(torch.int32)}, tokens_path)
    report = {"command": " ".join(sys.argv), "versions": versions(), "corpus_chunks": len(dataset),
              "corpus_tokens": dataset.num_tokens(), "tokenize_s": time.time() - t0}
    print(json.dumps(report), flush=True)
    common = ["--target", target_dir, "--tokens", tokens_path, "--overrides", args.overrides]

    # Calibration: find attention/compile settings that work and the DSpark step time.
    settings = None
    for attn, compile_flag in (("flex_attention", True), ("sdpa", True), ("sdpa", False)):
        out = os.path.join(work, f"calib-{attn}-{compile_flag}")
        extra = ["--steps", str(args.calibrate_steps), "--calibrate", "--attn", attn] + (["--compile"] if compile_flag else [])
        proc = run_worker("dspark", 0, out, extra, common)
        proc.wait()
        result_file = os.path.join(out, "worker_result.json")
        if proc.returncode == 0 and os.path.exists(result_file):
            with open(result_file) as f:
                calib = json.load(f)
            settings = (attn, compile_flag, calib["steady_step_s"])
            break
        print(open(out + ".log").read()[-3000:], flush=True)
    if settings is None:
        raise SystemExit("every calibration setting failed")
    attn, compile_flag, step_s = settings
    steps = max(args.min_steps, int(args.budget_s / step_s))
    report.update(attn_implementation=attn, compile=compile_flag, calibrated_step_s=step_s, steps=steps,
                  calibration_s=time.time() - started)
    print(json.dumps(report), flush=True)

    extra = ["--steps", str(steps), "--attn", attn] + (["--compile"] if compile_flag else [])
    procs = {mode: run_worker(mode, gpu, os.path.join(work, mode), extra, common)
             for gpu, mode in enumerate(("dspark", "dflash"))}
    for mode, proc in procs.items():
        proc.wait()
        if proc.returncode != 0:
            print(open(os.path.join(work, mode) + ".log").read()[-5000:], flush=True)
    runs = {}
    for mode in procs:
        path = os.path.join(work, mode, "worker_result.json")
        if os.path.exists(path):
            with open(path) as f:
                runs[mode] = json.load(f)
            dest = os.path.join(args.out, f"code50m-{mode}")
            os.makedirs(dest, exist_ok=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copy(os.path.join(work, mode, name), dest)
    report["runs"] = runs
    with open(os.path.join(args.out, "train_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)

    # Quick bf16 τ check on the GPU (the reported τ comes from the float32 `evaluate` phase).
    if args.gpu_eval_prompts and runs:
        from dspark_hf import DSparkDraftModel
        from dspark_hf.training.realtau import measure_tau

        device = "cuda" if torch.cuda.is_available() else "cpu"
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device)
        prompts = holdout_prompts(tokenizer, args.holdout, args.gpu_eval_prompts)
        report["gpu_tau_bf16"] = {}
        for mode in runs:
            drafter = DSparkDraftModel.from_pretrained(os.path.join(args.out, f"code50m-{mode}")).to(device)
            report["gpu_tau_bf16"][mode] = {
                f"t{temp:g}": measure_tau(target, drafter, prompts, args.max_new_tokens, temperature=temp)
                for temp in (0.0, 1.0)}
    report["total_s"] = time.time() - started
    with open(os.path.join(args.out, "train_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


# ---------------------------------------------------------------------------------------------- evaluation phase
def assistant_tau(target, assistant, prompts, max_new_tokens: int, temperature: float, gamma: int = 7) -> dict:
    """τ of HF assisted generation with a classic draft model (constant schedule, `gamma` tokens per round)."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    rounds: list[tuple[int, int]] = []  # (drafted, accepted)
    original = AssistedCandidateGenerator.update_candidate_strategy
    original_get = AssistedCandidateGenerator.get_candidates
    state = {}

    def get_candidates(self, input_ids, *a, **k):
        candidates, logits = original_get(self, input_ids, *a, **k)
        state["drafted"] = candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def update(self, input_ids, scores, num_matches):
        rounds.append((state.get("drafted", 0), int(num_matches)))
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.get_candidates = get_candidates
    AssistedCandidateGenerator.update_candidate_strategy = update
    assistant.generation_config.num_assistant_tokens = gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0,
                                                              "top_p": 1.0}
    try:
        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                ids = prompt[None]
                torch.manual_seed(i)
                target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                max_new_tokens=max_new_tokens, **sampling)
    finally:
        AssistedCandidateGenerator.get_candidates = original_get
        AssistedCandidateGenerator.update_candidate_strategy = original
    committed = [a + 1 for d, a in rounds if d > 0]
    drafted = [d for d, a in rounds if d > 0]
    conditional = []
    for k in range(gamma):
        reached = [c - 1 for d, c in zip(drafted, committed) if d > k and c - 1 >= k]
        conditional.append(sum(a > k for a in reached) / len(reached) if reached else float("nan"))
    return {"tau": sum(committed) / max(1, len(committed)), "rounds": len(committed),
            "conditional_acceptance": conditional}


def evaluate_phase(args) -> None:
    import dspark_hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_hf import DSparkDraftModel
    from dspark_hf.training.realtau import measure_tau

    torch.set_num_threads(args.threads)
    work = args.work
    os.makedirs(work, exist_ok=True)
    shared = os.path.join(ROOT, "..", "shared", "fixtures")
    target_dir = os.path.join(work, "target50m")
    assistant_dir = os.path.join(work, "assistant10m")
    materializer = os.path.join(shared, "materialize.py")
    for name, out in (("code-llama-50m", target_dir), ("code-llama-10m-assistant", assistant_dir)):
        if not os.path.exists(os.path.join(out, "model.safetensors")):
            subprocess.run([sys.executable, materializer, name, out], check=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    prompts = holdout_prompts(tokenizer, args.holdout, args.prompts)
    results = {"tau": {}, "conditional_acceptance": {}, "rounds": {}}
    drafters = {"dspark": os.path.join(args.drafters, "code50m-dspark"),
                "dflash": os.path.join(args.drafters, "code50m-dflash")}
    started = time.time()
    for temp in (0.0, 1.0):
        key = f"t{temp:g}"
        for name, path in drafters.items():
            drafter = DSparkDraftModel.from_pretrained(path, dtype=torch.float32)
            t = time.time()
            r = measure_tau(target, drafter, prompts, args.max_new_tokens, temperature=temp)
            print(f"{name} {key} {time.time() - t:.0f}s", flush=True)
            results["tau"].setdefault(name, {})[key] = r["tau"]
            results["conditional_acceptance"].setdefault(name, {})[key] = r["conditional_acceptance"]
            results["rounds"].setdefault(name, {})[key] = r["rounds"]
            print(name, key, r["tau"], flush=True)
        r = assistant_tau(target, assistant, prompts, args.max_new_tokens, temp)
        results["tau"].setdefault("assistant_10m", {})[key] = r["tau"]
        results["conditional_acceptance"].setdefault("assistant_10m", {})[key] = r["conditional_acceptance"]
        results["rounds"].setdefault("assistant_10m", {})[key] = r["rounds"]
        print("assistant_10m", key, r["tau"], flush=True)
    for key in ("t0", "t1"):
        results.setdefault("dspark_over_dflash", {})[key] = results["tau"]["dspark"][key] / results["tau"]["dflash"][key] - 1
    results["evaluation"] = {
        "prompts": len(prompts), "prompt_tokens": 128, "max_new_tokens": args.max_new_tokens, "gamma": 7,
        "prompt_set": "first 128 tokens of held-out Python files (build_code_corpus.py holdout, never trained on)",
        "dtype": "float32 on CPU (target and drafters)", "seconds": time.time() - started,
        "command": " ".join(sys.argv), "machine": f"{platform.machine()} CPU, {args.threads} threads",
        "versions": versions(),
        "assistant_10m": "HF assisted generation, num_assistant_tokens=7, schedule constant, confidence threshold 0",
    }
    if args.gpu_results and os.path.exists(args.gpu_results):
        with open(args.gpu_results) as f:
            gpu = json.load(f)
        results["training"] = {
            mode: {"steps": run["steps"], "train_tokens": run["train_tokens"], "train_seconds": run["train_seconds"],
                   "tokens_per_s": run["tokens_per_s"], "peak_memory_gib": run.get("peak_memory_gib"),
                   "final_metrics": run["history"][-1] if run.get("history") else None,
                   "loss_curve": [(h["step"], h["loss"]) for h in run.get("history", [])]}
            for mode, run in gpu.get("runs", {}).items()}
        results["training_setup"] = {k: gpu.get(k) for k in (
            "command", "versions", "corpus_chunks", "corpus_tokens", "attn_implementation", "compile",
            "calibrated_step_s", "steps", "gpu_tau_bf16")}
        results["training_setup"]["machine"] = ("nvidia-h200-x2: DSpark on GPU 0 and DFlash on GPU 1, concurrently, "
                                                "same steps/data/anchors; bf16 autocast")
    out = os.path.join(HERE, "results", "train_code50m.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(HERE, "results", "train_code50m.png"))
    print(json.dumps(results["tau"], indent=1))


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key in zip(axes, ("t0", "t1")):
        for name, curves in results["conditional_acceptance"].items():
            values = curves[key]
            ax.plot(range(1, len(values) + 1), values, marker="o",
                    label=f"{name} (τ={results['tau'][name][key]:.2f})")
        ax.set_title(f"temperature {0 if key == 't0' else 1.0}")
        ax.set_xlabel("draft position k")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("P(accept k | accepted < k)")
    fig.suptitle("50M code target, γ = 7: position-wise conditional acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    t = sub.add_parser("train")
    t.add_argument("--fixture", required=True)
    t.add_argument("--materializer", default=os.path.join(ROOT, "carry", "materialize.py"))
    t.add_argument("--corpus", required=True)
    t.add_argument("--holdout", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--work", default="/tmp/train_code50m")
    t.add_argument("--budget-s", type=float, default=140)
    t.add_argument("--calibrate-steps", type=int, default=16)
    t.add_argument("--gpu-eval-prompts", type=int, default=8)
    t.add_argument("--max-new-tokens", type=int, default=96)
    t.add_argument("--min-steps", type=int, default=50)
    t.add_argument("--overrides", default="{}", help="JSON TrainingConfig overrides (dry runs)")
    w = sub.add_parser("_worker")
    w.add_argument("--mode", required=True)
    w.add_argument("--output", required=True)
    w.add_argument("--target", required=True)
    w.add_argument("--tokens", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--attn", default="flex_attention")
    w.add_argument("--compile", action="store_true")
    w.add_argument("--calibrate", action="store_true")
    w.add_argument("--logging-steps", type=int, default=25)
    w.add_argument("--overrides", default="{}")
    e = sub.add_parser("evaluate")
    e.add_argument("--holdout", default=os.path.join(ROOT, "carry", "corpus.holdout.txt"))
    e.add_argument("--prompts", type=int, default=24)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--drafters", default=os.path.join(ROOT, "drafters"), help="folder holding code50m-{dspark,dflash}")
    e.add_argument("--work", default="/tmp/eval_code50m")
    e.add_argument("--gpu-results", default=os.path.join(HERE, "results", "train_code50m.gpu.json"))
    args = parser.parse_args()
    {"train": train_phase, "_worker": worker, "evaluate": evaluate_phase}[args.phase](args)


if __name__ == "__main__":
    main()
