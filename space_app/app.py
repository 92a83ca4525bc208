"""DSpark speculative decoding, side by side with plain decoding (a Gradio Space).

Each decoding is its own `target.generate()` call, plain first, then DSpark, one after the other so that neither
slows the other down. DSpark's tokens are coloured by how they were produced (accepted draft, bonus token after a
fully accepted block, the target's correction after a rejection), read from `drafter.generation_stats` round by round.

    python space_app/app.py            # http://127.0.0.1:7860 (GRADIO_SERVER_PORT / GRADIO_SERVER_NAME change it)
"""

from __future__ import annotations

import html
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import dspark_hf  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent / "src"))
    import dspark_hf  # noqa: F401

import gradio as gr
import torch

from dspark_hf.demo import (
    DEFAULT_PROMPT,
    TOKEN_KINDS,
    DemoPair,
    find_demo_models,
    load_demo_pair,
    generate_streamed,
    token_pieces,
)

EMBEDDED = "embedded demo pair (demo_models/)"
TINY = "tiny random pair (offline, untrained)"
CUSTOM = "Hub ids or local folders"
POLICIES = {
    "fixed": "fixed: verify all γ drafts",
    "static_threshold": "static threshold on the conditional confidence",
    "hardware_aware": "hardware-aware (Algorithm 1, sync)",
    "hardware_aware_async": "hardware-aware (async)",
}
COLOURS = {"accepted": "#bbf7d0", "bonus": "#bae6fd", "corrected": "#fde68a", "target": "#e5e7eb", "plain": "transparent"}
HUB_EXAMPLE = ("Qwen/Qwen3-4B", "deepseek-ai/dspark_qwen3_4b_block7")

_pairs: dict[tuple, DemoPair] = {}
_sps_tables: dict[tuple, object] = {}
_lock = threading.Lock()


def embedded_folder() -> Path | None:
    """demo_models/ beside this app (a Space repo ships it there), else wherever `dspark-hf demo` finds it."""
    return find_demo_models(HERE / "demo_models") or find_demo_models()


def pair_choices() -> list[str]:
    """The embedded pair first when present; `DSPARK_SPACE_PAIR=tiny` makes the tiny random pair the default."""
    choices = ([EMBEDDED] if embedded_folder() else []) + [TINY, CUSTOM]
    if os.environ.get("DSPARK_SPACE_PAIR") == "tiny":
        choices.remove(TINY)
        choices.insert(0, TINY)
    return choices


def get_pair(choice: str, target_id: str, drafter_id: str) -> DemoPair:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == CUSTOM:
        if not target_id or not drafter_id:
            raise gr.Error("Give a target and a DSpark drafter (Hub ids or local folders).")
        key = (target_id.strip(), drafter_id.strip())
    elif choice == EMBEDDED:
        key = ("embedded",)
    else:
        key = ("tiny",)
    with _lock:
        if key not in _pairs:
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            try:
                if key == ("tiny",):
                    # an empty folder: load_demo_pair then falls back to the tiny random pair
                    _pairs[key] = load_demo_pair(device=device, demo_models=tempfile.mkdtemp())
                elif key == ("embedded",):
                    _pairs[key] = load_demo_pair(dtype=dtype, device=device, demo_models=embedded_folder())
                else:
                    _pairs[key] = load_demo_pair(key[0], key[1], dtype=dtype, device=device)
            except (OSError, ValueError) as error:
                raise gr.Error(f"Could not load the pair: {error}") from error
        return _pairs[key]


def sps_table(pair: DemoPair):
    """The hardware-aware policies need the target's steps/s vs verified tokens: a quick profile, once per pair."""
    from dspark_hf.scheduling import SPSTable

    key = id(pair.target)
    if key not in _sps_tables:
        _sps_tables[key] = SPSTable.profile(pair.target, batch_tokens=(1, 2, 4, 8, 16), context_length=128,
                                            warmup=1, repeats=3, progress=False)
    return _sps_tables[key]


# ---------------------------------------------------------------------------------------------- rendering
def render_tokens(pair: DemoPair, prompt: str, segments: list[tuple[int, str]]) -> str:
    pieces = token_pieces(pair.tokenizer, [t for t, _ in segments])
    spans = [f'<span class="tok tok-{kind}" title="{kind}" style="background:{COLOURS[kind]};border-radius:3px">'
             f"{html.escape(piece)}</span>" for piece, (_, kind) in zip(pieces, segments)]
    return ('<div class="dspark-out" style="white-space:pre-wrap;font-family:monospace;font-size:0.9em;'
            f'line-height:1.5;min-height:8em"><span style="color:#6b7280">{html.escape(prompt)}</span>'
            + "".join(spans) + "</div>")


def legend() -> str:
    items = [f'<span class="tok tok-{k}" style="background:{COLOURS[k]};padding:0 4px;border-radius:3px">{k}</span> '
             f"{html.escape(TOKEN_KINDS[k])}" for k in ("accepted", "bonus", "corrected", "target")]
    return '<div class="dspark-legend" style="font-size:0.85em">' + " &nbsp;·&nbsp; ".join(items) + "</div>"


def speed_line(recorder, done: bool) -> str:
    tokens = len(recorder.token_ids)
    elapsed = recorder.times[-1] if recorder.times else 0.0
    rate = tokens / elapsed if elapsed > 0 else 0.0
    return f"**{rate:.1f} tokens/s** · {tokens} tokens · {elapsed:.2f} s" + ("" if done else " · generating…")


def acceptance_figure(rates: list[float], tau: float, gamma: int):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 2.8), dpi=100)
    axes = figure.add_subplot(1, 1, 1)
    positions = list(range(1, len(rates) + 1))
    values = [0.0 if r != r else r for r in rates]  # NaN (never proposed) -> 0
    axes.bar(positions, values, color="#16a34a")
    axes.set_ylim(0, 1)
    axes.set_xticks(positions)
    axes.set_xlabel("draft position k")
    axes.set_ylabel("accept rate @k")
    axes.set_title(f"acceptance per draft position (τ = {tau:.2f}, γ ≤ {gamma})", fontsize=10)
    figure.tight_layout()
    return figure


def calibration_image(pair: DemoPair) -> str | None:
    """Reliability diagram of this generation's rounds (confidence vs survival), when the drafter has a
    confidence head; with STS temperatures in its config, the calibrated curve too."""
    from dspark_hf.calibration import reliability_diagram

    stats = pair.drafter.generation_stats
    rows = [(conf, d, a) for conf, d, a in zip(stats.confidence_logits, stats.drafted, stats.accepted) if d > 0]
    if pair.drafter.confidence_head is None or not rows:
        return None
    width = max(d for _, d, _ in rows)
    logits = torch.zeros(len(rows), width)
    for i, (conf, d, _) in enumerate(rows):
        logits[i, :d] = conf[:d].float()
    drafted = torch.tensor([d for _, d, _ in rows])[:, None]
    accepted = torch.tensor([a for _, _, a in rows])[:, None]
    slots = torch.arange(width)[None]
    temperatures = pair.drafter.config.sts_temperatures
    path = Path(tempfile.mkdtemp()) / "reliability.png"
    reliability_diagram(logits, slots < accepted, path, valid_mask=slots < drafted,
                        temperatures=temperatures[:width] if temperatures else None,
                        positions=list(range(1, min(width, 4) + 1)),
                        title=f"confidence calibration on this generation's {len(rows)} rounds")
    return str(path)


# ---------------------------------------------------------------------------------------------- the event
def generate(choice, target_id, drafter_id, prompt, chat, temperature, gamma, policy, threshold, max_new_tokens,
             seed):
    """Streams plain decoding, then DSpark; yields (plain html, plain speed, dspark html, dspark speed, chart,
    calibration image, summary)."""
    pair = get_pair(choice, target_id, drafter_id)
    try:
        input_ids = pair.encode(prompt, bool(chat))
    except ValueError as error:
        raise gr.Error(str(error)) from error
    gamma = int(gamma)
    kwargs = {"max_new_tokens": int(max_new_tokens), "do_sample": temperature > 0}
    if temperature > 0:
        kwargs["temperature"] = float(temperature)
    if getattr(pair.tokenizer, "eos_token_id", None) is None:
        kwargs["eos_token_id"] = None
    dspark_kwargs = {"dspark_policy": policy}
    if policy == "static_threshold":
        dspark_kwargs["dspark_threshold"] = float(threshold)
    elif policy.startswith("hardware_aware"):
        dspark_kwargs["dspark_sps_table"] = sps_table(pair)

    empty = render_tokens(pair, prompt, [])
    state = {"plain": (empty, "waiting…"), "dspark": (empty, "waiting…")}
    rates = {}
    for kind in ("plain", "dspark"):
        result, error = {}, []

        def work(kind=kind, result=result, error=error):
            try:
                extra = dspark_kwargs if kind == "dspark" else {}
                result["run"] = generate_streamed(pair, input_ids, kind == "dspark", seed=int(seed), gamma=gamma,
                                                  on_put=lambda r: result.setdefault("recorder", r), **kwargs, **extra)
            except Exception as exc:  # shown in the UI below
                error.append(exc)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.15)
            recorder = result.get("recorder")
            if recorder is not None:
                state[kind] = (render_tokens(pair, prompt, recorder.segments()), speed_line(recorder, False))
                yield (*state["plain"], *state["dspark"], None, None, "")
        if error:
            raise gr.Error(f"{kind} generation failed: {error[0]}")
        recorder, _ = result["run"]
        state[kind] = (render_tokens(pair, prompt, recorder.segments()), speed_line(recorder, True))
        rates[kind] = recorder.tokens_per_second
        yield (*state["plain"], *state["dspark"], None, None, "")

    stats = pair.drafter.generation_stats
    figure = acceptance_figure(stats.acceptance_by_position(), stats.tau, gamma)
    summary = (f"**τ = {stats.tau:.2f}** accepted tokens per round (bonus included) over {stats.rounds} rounds · "
               f"speedup **×{rates['dspark'] / max(rates['plain'], 1e-9):.2f}** (wall clock, this machine) · policy `{policy}`, "
               f"γ ≤ {gamma}")
    if not pair.trained:
        summary += ("\n\n*Random weights: drafts are almost never accepted, so DSpark is slower here. "
                    "The output is still exactly plain decoding's.*")
    yield (*state["plain"], *state["dspark"], figure, calibration_image(pair), summary)


def on_pair_change(choice):
    custom = choice == CUSTOM
    return gr.update(visible=custom), gr.update(visible=custom)


def build_app() -> gr.Blocks:
    choices = pair_choices()
    with gr.Blocks(title="DSpark speculative decoding") as app:
        gr.Markdown(
            "# DSpark speculative decoding\n"
            "A small drafter reads the target's hidden states and drafts a block of tokens in one forward; the "
            "target verifies them with rejection sampling, so **the output is exactly the target's** (greedy: token "
            "for token). Left: plain `generate()`. Right: `generate(assistant_model=drafter)`. They run one after "
            "the other, each in its own `generate()` call."
        )
        with gr.Row():
            with gr.Column(scale=1):
                pair_choice = gr.Dropdown(choices, value=choices[0], label="target + drafter")
                target_id = gr.Textbox(HUB_EXAMPLE[0], label="target (Hub id or folder)", visible=False)
                drafter_id = gr.Textbox(HUB_EXAMPLE[1], label="DSpark drafter (Hub id or folder)", visible=False)
                prompt = gr.Textbox(DEFAULT_PROMPT, label="prompt", lines=3)
                chat = gr.Checkbox(False, label="chat: wrap the prompt in the target's chat template")
            with gr.Column(scale=1):
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)")
                gamma = gr.Slider(1, 7, value=7, step=1, label="γ: most drafted tokens verified per round",
                                  info="generate(dspark_gamma=γ). Capped by the drafter's block size (7 here); the "
                                       "drafter still drafts its whole block in one forward. The policy may verify "
                                       "fewer.")
                policy = gr.Dropdown([(v, k) for k, v in POLICIES.items()], value="fixed", label="scheduler policy")
                threshold = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="threshold (static threshold policy)")
                max_new_tokens = gr.Slider(8, 256, value=int(os.environ.get("DSPARK_SPACE_MAX_NEW_TOKENS", 64)), step=8,
                                           label="max new tokens")
                seed = gr.Number(0, precision=0, label="seed")
        run = gr.Button("Generate", variant="primary")
        gr.HTML(legend())
        with gr.Row():
            with gr.Column():
                gr.Markdown("### plain decoding")
                plain_html = gr.HTML(elem_id="plain-output")
                plain_speed = gr.Markdown()
            with gr.Column():
                gr.Markdown("### DSpark")
                dspark_html = gr.HTML(elem_id="dspark-output")
                dspark_speed = gr.Markdown()
        summary = gr.Markdown(elem_id="summary")
        with gr.Row():
            chart = gr.Plot(label="acceptance per draft position", show_label=False)
            calibration = gr.Image(label="confidence calibration (reliability diagram)", type="filepath")
        pair_choice.change(on_pair_change, pair_choice, [target_id, drafter_id])
        run.click(generate,
                  [pair_choice, target_id, drafter_id, prompt, chat, temperature, gamma, policy, threshold,
                   max_new_tokens, seed],
                  [plain_html, plain_speed, dspark_html, dspark_speed, chart, calibration, summary],
                  api_name="generate")
    return app


app = build_app()

if __name__ == "__main__":
    app.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), theme=gr.themes.Soft())
