"""`DrafterTrainer`: online DSpark/DFlash drafter training on `accelerate` (1 process or N with DDP; FSDP optional).

One optimizer step = one global batch of `batch_size` sequences, split across processes and `micro_batch_size`
forwards. The step's sample indices and each sample's anchors depend only on (seed, epoch, sample index), and the
loss is normalised by the global weight sum, so 1 GPU and N GPUs at the same global batch compute the same gradient
and a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch
from torch import nn

from ..models import DSparkDraftModel
from ..models.modeling import SHAREABLE_WEIGHTS
from .checkpoint import checkpoint_dir, latest_checkpoint, load_training_state, optimizer_from_tensors, save_checkpoint
from .config import TrainingConfig, build_drafter_config
from .data import TokenizedDataset, collate
from .features import FeatureCache, TargetFeatureExtractor, TargetFeatures
from .losses import loss_terms, position_weights
from .masks import build_block_layout, sample_anchors
from .objective import DraftObjective


def cosine_with_warmup(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, epoch, index)) & ((1 << 62) - 1))


class DrafterTrainer:
    """Trains a drafter for `target` on `dataset` (token ids + loss masks); writes under `output_dir`.

    `output_dir` receives the final drafter (loadable with `DSparkDraftModel.from_pretrained`), `training_config.json`,
    `metrics.jsonl`, and `checkpoints/step-*/` for resuming.
    """

    def __init__(self, target, tokenizer, dataset: TokenizedDataset, config: TrainingConfig, output_dir: str,
                 eval_prompts: list[torch.Tensor] | None = None, drafter: DSparkDraftModel | None = None,
                 accelerator=None, resume: bool = True, progress: bool = True):
        from accelerate import Accelerator

        self.config = config
        self.output_dir = output_dir
        self.dataset = dataset
        self.eval_prompts = eval_prompts or []
        self.progress = progress
        self.tokenizer = tokenizer
        cuda = torch.cuda.is_available()
        precision = config.precision if config.precision != "auto" else ("bf16" if cuda else "fp32")
        if accelerator is None:
            kwargs = {}
            if config.distributed == "fsdp":
                from accelerate.utils import FullyShardedDataParallelPlugin

                kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(use_orig_params=True)
            accelerator = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no", cpu=not cuda,
                                      **kwargs)
        self.accelerator = accelerator
        self.device = accelerator.device
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        per_step = self.world * config.micro_batch_size
        if config.batch_size % per_step:
            raise ValueError(f"batch_size {config.batch_size} must be a multiple of num_processes × micro_batch_size "
                             f"= {self.world} × {config.micro_batch_size}.")
        self.steps_per_epoch = len(dataset) // config.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"The dataset has {len(dataset)} samples, fewer than one global batch ({config.batch_size}).")
        self.total_steps = config.max_steps or max(1, int(config.num_epochs * self.steps_per_epoch))

        # --- target (frozen) and drafter
        self.target = target.to(self.device) if next(target.parameters()).device != self.device else target
        self.extractor = None
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        if drafter is None:
            torch.manual_seed(config.seed)
            drafter = DSparkDraftModel(build_drafter_config(target.config, config, tokenizer))
        implementation = config.attn_implementation
        if implementation == "auto":
            implementation = "flex_attention" if cuda else "sdpa"
        drafter.set_attn_implementation(implementation)
        drafter = drafter.to(device=self.device, dtype=torch.float32)
        drafter.weights_from_target.update(SHAREABLE_WEIGHTS.values())
        drafter.share_target_weights(self.target)
        drafter.train()
        self.drafter = drafter
        self.extractor = TargetFeatureExtractor(self.target, drafter.config.target_layer_ids)
        self.param_names = [n for n, p in drafter.named_parameters() if p.requires_grad]
        params = [p for p in drafter.parameters() if p.requires_grad]
        head = self.target.get_output_embeddings()
        softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        objective = DraftObjective(drafter, head, config.loss_weights, softcap)
        if config.compile:
            objective.loss_fn = torch.compile(loss_terms, dynamic=False)
        objective._ddp_params_and_buffers_to_ignore = [f"drafter.{k}" for k in SHAREABLE_WEIGHTS]
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=config.adam_betas,
                                      weight_decay=config.weight_decay)
        self.step = 0
        self.history: list[dict] = []
        self.step_losses: list[float] = []
        resume_from = latest_checkpoint(output_dir) if resume else None
        if resume_from:
            self._load(resume_from, optimizer)
        self.objective, self.optimizer = accelerator.prepare(objective, optimizer)
        self.raw_optimizer = optimizer
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(self.total_steps, warmup))
        for group in optimizer.param_groups:  # LambdaLR sets lr for step 0; replay to the resumed step
            group["lr"] = group["initial_lr"] * self.scheduler.lr_lambdas[0](self.step)
        self.scheduler.last_epoch = self.step
        self.cache = self._prepare_cache() if config.feature_cache else None
        self._perm: tuple[int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ data
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed + 7919 * epoch)
            self._perm = (epoch, torch.randperm(len(self.dataset), generator=generator))
        return self._perm[1]

    def step_indices(self, step: int) -> tuple[int, list[int]]:
        """(epoch, this process's sample indices) for a global step."""
        epoch, position = divmod(step, self.steps_per_epoch)
        size = self.config.batch_size
        indices = self._epoch_order(epoch)[position * size : (position + 1) * size].tolist()
        share = size // self.world
        return epoch, indices[self.rank * share : (self.rank + 1) * share]

    def _prepare_cache(self) -> FeatureCache:
        path = self.config.feature_cache
        cache = FeatureCache(path, self.drafter.config.target_layer_ids)
        if cache.complete and len(cache) == len(self.dataset):
            return cache
        if self.accelerator.is_main_process:
            cache = FeatureCache(path + ".building", self.drafter.config.target_layer_ids)
            for i in range(len(self.dataset)):
                ids, mask = self.dataset[i]
                feats = self.extractor(ids[None].to(self.device))
                cache.add(ids, mask, TargetFeatures(feats.hidden[0], feats.last_hidden[0]))
            cache.close()
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            os.replace(path + ".building", path)
        self.accelerator.wait_for_everyone()
        return FeatureCache(path, self.drafter.config.target_layer_ids)

    def _micro_batch(self, epoch: int, indices: list[int]):
        samples = [self.dataset[i] for i in indices]
        batch = {k: v.to(self.device) for k, v in collate(samples, self.pad_id).items()}
        anchors = sample_anchors(batch["loss_mask"], self.config.num_anchors,
                                 [_sample_generator(self.config.seed, epoch, i) for i in indices])
        return indices, batch, anchors

    def _features(self, indices: list[int], batch: dict) -> TargetFeatures:
        if self.cache is None:
            mask = batch["attention_mask"]
            return self.extractor(batch["input_ids"], None if bool(mask.all()) else mask)
        length = batch["input_ids"].shape[1]
        hidden, last = [], []
        for i in indices:
            _, _, feats = self.cache[i]
            pad = length - feats.hidden.shape[0]
            hidden.append(nn.functional.pad(feats.hidden, (0, 0, 0, pad)))
            last.append(nn.functional.pad(feats.last_hidden, (0, 0, 0, pad)))
        return TargetFeatures(torch.stack(hidden).to(self.device), torch.stack(last).to(self.device))

    # ------------------------------------------------------------------ training
    def train_step(self) -> dict:
        config = self.config
        epoch, local = self.step_indices(self.step)
        micro = [self._micro_batch(epoch, local[i : i + config.micro_batch_size])
                 for i in range(0, len(local), config.micro_batch_size)]
        block_size = self.drafter.config.block_size
        local_weight = torch.zeros((), device=self.device)
        for _, batch, anchors in micro:
            layout = build_block_layout(batch["input_ids"], batch["loss_mask"], anchors, block_size,
                                        self.drafter.config.mask_token_id)
            local_weight += position_weights(layout.eval_mask, config.loss_decay_gamma).sum()
        global_weight = self.accelerator.reduce(local_weight.clone(), reduction="sum").clamp(min=1e-6)

        # Sums reduced over micro-batches and processes: [ce, l1, confidence, total, valid slots (γ), top-1 hits (γ),
        # α* (γ), Σ(1 + Σcumprod α*) over full blocks, full blocks, |c - α*|, tokens].
        g = block_size
        sums = torch.zeros(8 + 3 * g, device=self.device, dtype=torch.float64)
        valid_at, top1_at, alpha_at, tau_at = 4, 4 + g, 4 + 2 * g, 4 + 3 * g
        unwrapped = self.accelerator.unwrap_model(self.objective)
        unwrapped.compute_alpha = (self.step + 1) % config.logging_steps == 0 or self.step + 1 == self.total_steps
        has_alpha = False
        for position, (indices, batch, anchors) in enumerate(micro):
            features = self._features(indices, batch)
            sync = position == len(micro) - 1
            context = contextlib.nullcontext() if sync else self.accelerator.no_sync(self.objective)
            with context:
                out = self.objective(batch["input_ids"], batch["loss_mask"], features.hidden, features.last_hidden,
                                     anchors.positions, anchors.keep)
                self.accelerator.backward(out["total"] / global_weight * self.world)
            slots = out["eval_mask"].float().reshape(-1, g)
            for i, key in enumerate(("ce", "l1", "confidence", "total")):
                sums[i] += out[key].detach().double()
            sums[valid_at:top1_at] += slots.sum(0).double()
            sums[top1_at:alpha_at] += out["top1_correct"].reshape(-1, g).sum(0).double()
            if "alpha" in out:
                has_alpha = True
                alpha = out["alpha"].reshape(-1, g)
                sums[alpha_at:tau_at] += (alpha * slots).sum(0).double()
                full = slots.bool().all(-1)
                sums[tau_at] += (1 + alpha[full].cumprod(-1).sum(-1)).sum().double()
                sums[tau_at + 1] += full.sum().double()
                if out["confidence_logits"] is not None:
                    conf = torch.sigmoid(out["confidence_logits"].float()).reshape(-1, g)
                    sums[tau_at + 2] += ((conf - alpha).abs() * slots).sum().double()
            sums[tau_at + 3] += float(batch["attention_mask"].sum())
        grad_norm = self.accelerator.clip_grad_norm_(
            [p for p in self.drafter.parameters() if p.requires_grad], config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        sums = self.accelerator.reduce(sums, reduction="sum")
        weight = float(global_weight)
        counts = sums[valid_at:top1_at].clamp(min=1)
        metrics = {
            "step": self.step + 1,
            "loss": float(sums[3]) / weight,
            "ce": float(sums[0]) / weight,
            "l1": float(sums[1]) / weight,
            "confidence_bce": float(sums[2]) / weight,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "tokens": int(sums[tau_at + 3]),
        }
        metrics.update({f"top1@{k + 1}": float(v) for k, v in enumerate(sums[top1_at:alpha_at] / counts)})
        if has_alpha:
            metrics.update({f"accept_rate@{k + 1}": float(v) for k, v in enumerate(sums[alpha_at:tau_at] / counts)})
            metrics["tau_expected"] = float(sums[tau_at] / sums[tau_at + 1].clamp(min=1))
            if self.drafter.confidence_head is not None:
                metrics["confidence_abs_error"] = float(sums[tau_at + 2] / counts.sum())
        self.step += 1
        self.step_losses.append(metrics["loss"])
        return metrics

    def train(self) -> dict:
        from tqdm.auto import tqdm

        config = self.config
        main = self.accelerator.is_main_process
        if main:
            os.makedirs(self.output_dir, exist_ok=True)
            config.to_json(os.path.join(self.output_dir, "training_config.json"))
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {config.mode}", disable=not (main and self.progress))
        started, tokens, window = time.perf_counter(), 0, []
        while self.step < self.total_steps:
            metrics = self.train_step()
            tokens += metrics["tokens"]
            window.append(metrics)
            bar.update(1)
            last = self.step == self.total_steps
            if self.step % config.logging_steps == 0 or last:
                record = self._average(window)
                record["tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - started)
                record["elapsed_s"] = time.perf_counter() - started
                window = []
                if config.eval_steps and self.step % config.eval_steps == 0 and self.eval_prompts:
                    record.update(self.evaluate())
                self.history.append(record)
                if main:
                    with open(os.path.join(self.output_dir, "metrics.jsonl"), "a") as f:
                        f.write(json.dumps(record) + "\n")
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record.get('tau_expected', math.nan):.2f}")
            if config.save_steps and self.step % config.save_steps == 0 and not last:
                self.save_checkpoint()
        bar.close()
        elapsed = time.perf_counter() - started
        summary = {"steps": self.step, "train_seconds": elapsed, "train_tokens": tokens,
                   "tokens_per_s": tokens / max(1e-9, elapsed)}
        if self.eval_prompts:
            summary.update(self.evaluate())
        self.save_checkpoint()
        self.export(self.output_dir)
        if main:
            with open(os.path.join(self.output_dir, "train_summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        return summary

    @staticmethod
    def _average(records: list[dict]) -> dict:
        out = {}
        for key in records[-1]:
            values = [r[key] for r in records if key in r]
            out[key] = records[-1][key] if key in ("step", "lr") else (
                sum(values) if key == "tokens" else sum(values) / len(values))
        return out

    def evaluate(self) -> dict:
        """Real τ at temperature 0 on the held-out prompts (main process; the others wait)."""
        from .realtau import measure_tau

        result = {}
        if self.accelerator.is_main_process:
            drafter = self.accelerator.unwrap_model(self.objective).drafter
            tau = measure_tau(self.target, drafter, self.eval_prompts[: self.config.eval_num_prompts],
                              self.config.eval_max_new_tokens)
            result = {"real_tau": tau["tau"], "real_accept_rate_by_position": tau["accept_rate_by_position"]}
        self.accelerator.wait_for_everyone()
        return result

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        path = checkpoint_dir(self.output_dir, self.step)
        if self.accelerator.is_main_process:
            state = {"step": self.step, "total_steps": self.total_steps, "dataset_size": len(self.dataset),
                     "config": self.config.to_dict(), "step_losses": self.step_losses}
            save_checkpoint(path, self.accelerator.unwrap_model(self.objective).drafter, self.raw_optimizer,
                            self.param_names, state)
        self.accelerator.wait_for_everyone()
        return path

    def _load(self, path: str, optimizer) -> None:
        from safetensors.torch import load_file

        state, optimizer_tensors = load_training_state(path)
        if state["dataset_size"] != len(self.dataset) or state["config"]["batch_size"] != self.config.batch_size:
            raise ValueError(f"The checkpoint {path} was made with another dataset or batch size; use a new output_dir "
                             "or resume=False.")
        weights = load_file(os.path.join(path, "model.safetensors"))
        missing, unexpected = self.drafter.load_state_dict(weights, strict=False)
        if set(missing) - set(SHAREABLE_WEIGHTS) or unexpected:
            raise ValueError(f"The checkpoint {path} does not fit this drafter: missing {missing}, unexpected {unexpected}.")
        optimizer_from_tensors(optimizer, self.param_names, optimizer_tensors, state["optimizer_scalars"])
        self.step = state["step"]
        self.step_losses = list(state.get("step_losses", []))

    def export(self, directory: str) -> None:
        """Saves the drafter for inference (no embedding/LM head: they come from the target) in `save_dtype`."""
        if self.accelerator.is_main_process:
            drafter = self.accelerator.unwrap_model(self.objective).drafter
            dtype = getattr(torch, self.config.save_dtype)
            state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in drafter.state_dict().items()
                     if k not in SHAREABLE_WEIGHTS}
            implementation = drafter.config._attn_implementation
            drafter.set_attn_implementation("sdpa")
            drafter.save_pretrained(directory, state_dict=state)
            drafter.set_attn_implementation(implementation)
            with open(os.path.join(directory, "config.json")) as f:
                saved = json.load(f)
            saved["dtype"] = self.config.save_dtype
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(saved, f, indent=2, sort_keys=True)
        self.accelerator.wait_for_everyone()


def train_drafter(target, tokenizer, dataset: TokenizedDataset, config: TrainingConfig, output_dir: str,
                  eval_prompts: list[torch.Tensor] | None = None, resume: bool = True, progress: bool = True) -> dict:
    """Trains a DSpark (or DFlash, `config.mode="dflash"`) drafter for `target`; returns the run summary.

    The trained drafter is in `output_dir`: `DSparkDraftModel.from_pretrained(output_dir)` then
    `target.generate(ids, assistant_model=drafter)`.
    """
    trainer = DrafterTrainer(target, tokenizer, dataset, config, output_dir, eval_prompts=eval_prompts, resume=resume,
                             progress=progress)
    return trainer.train()
