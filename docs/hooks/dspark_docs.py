"""MkDocs hook for the dspark_hf site (registered in mkdocs.yml under `hooks:`).

At build time it:

- adds the design notes other parts of the project keep in docs/ (verify.md, scheduling.md, training.md, formats.md,
  serving.md, serving_measurements.md) to the nav when they exist, and turns links to absent ones into plain text;
- generates one API reference page per `dspark_hf` subpackage that exists (mkdocstrings renders the docstrings);
- renders every `benchmarks/results/*.json` (and its PNG) into `benchmarks.md`;
- lists every `ValueError` message raised under `src/dspark_hf` into `errors.md` (read with `ast`, nothing imported).
"""

from __future__ import annotations

import ast
import html
import json
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "dspark_hf"
RESULTS = ROOT / "benchmarks" / "results"

DESIGN_NOTES = [("Verification", "verify.md"), ("Scheduling", "scheduling.md"), ("Training", "training.md"),
                ("Checkpoint formats", "formats.md"), ("Serving", "serving.md"),
                ("Serving measurements", "serving_measurements.md")]
API_MODULES = [
    ("Models", "dspark_hf.models", "models", ["dspark_hf.DSparkConfig", "dspark_hf.DSparkDraftModel",
                                             "dspark_hf.DraftProposal"]),
    ("Generation", "dspark_hf.generation", "generation", ["dspark_hf.DSparkStats", "dspark_hf.generation.policy",
                                                          "dspark_hf.generation.hook",
                                                          "dspark_hf.generation.profiling",
                                                          "dspark_hf.generation.static_loop",
                                                          "dspark_hf.generation.static_profile",
                                                          "dspark_hf.generation.static_attention",
                                                          "dspark_hf.generation.fused_projections",
                                                          "dspark_hf.generation.compile_regions",
                                                          "dspark_hf.attention_backends"]),
    ("Evaluation", "dspark_hf.evaluation", "evaluation", None),
    ("Calibration", "dspark_hf.calibration", "calibration", None),
    ("Scheduling", "dspark_hf.scheduling", "scheduling", None),
    ("Verification", "dspark_hf.verify", "verify", None),
    ("Training", "dspark_hf.training", "training", None),
    ("Checkpoints", "dspark_hf.checkpoints", "checkpoints", None),
    ("Serving", "dspark_hf.serving", "serving", ["dspark_hf.serving", "dspark_hf.serving.admission"]),
    ("Demo helpers", "dspark_hf.demo", "demo.py", None),
]


def _present_notes(docs_dir: Path) -> list[tuple[str, str]]:
    return [(title, name) for title, name in DESIGN_NOTES if (docs_dir / name).is_file()]


def _present_api() -> list[tuple[str, str, list[str]]]:
    out = []
    for title, module, path, objects in API_MODULES:
        if (SRC / path).exists():
            out.append((title, module, objects or [module]))
    return out


def on_config(config):
    docs_dir = Path(config["docs_dir"])
    nav = config["nav"]
    notes = _present_notes(docs_dir)
    api = [{title: f"api/{module.split('.')[-1]}.md"} for title, module, _ in _present_api()]
    for index, entry in enumerate(nav):
        if isinstance(entry, dict) and "Design notes" in entry:
            nav[index] = {"Design notes": [{title: name} for title, name in notes] or ["index.md"]}
        if isinstance(entry, dict) and "API reference" in entry:
            nav[index] = {"API reference": ["api/index.md", *api]}
    return config


def on_files(files, config):
    for title, module, objects in _present_api():
        body = "\n\n".join(f"::: {name}" for name in objects)
        files.append(File.generated(config, f"api/{module.split('.')[-1]}.md", content=f"# {title}\n\n{body}\n"))
    files.append(File.generated(config, "api/index.md", content=_api_index()))
    files.append(File.generated(config, "benchmarks.md", content=_benchmarks_page()))
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    files.append(File.generated(config, "errors.md", content=_errors_page()))
    return files


_LINK = re.compile(r"\[([^\]]+)\]\((?:\.\./)?(verify|scheduling|training|formats|serving)\.md(#[^)]*)?\)")


_ANY_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
NOTE_NAMES = {name for _, name in DESIGN_NOTES}


def _outside_link(match, page_dir: Path, docs_dir: Path) -> str:
    """In a design note: a relative link to a file outside docs/ (code, results) becomes text + the path in code."""
    text, target = match.group(1), match.group(2)
    if re.match(r"^[a-z]+:|^#|^/", target):
        return match.group(0)
    path = target.split("#")[0]
    resolved = (page_dir / path).resolve()
    if path and (docs_dir.resolve() not in resolved.parents or not resolved.exists()):
        try:
            shown = resolved.relative_to(ROOT)
        except ValueError:
            shown = Path(path)
        return f"{text} (`{shown}`)"
    return match.group(0)


def on_page_markdown(markdown, page, config, files):
    """Links to a design note that is not in this checkout become plain text (the note may land later). Design notes
    written alongside the code may link to files outside docs/: those links become the path in code."""
    docs_dir = Path(config["docs_dir"])
    markdown = _LINK.sub(lambda m: m.group(0) if (docs_dir / f"{m.group(2)}.md").is_file() else m.group(1), markdown)
    if page.file.src_uri in NOTE_NAMES:
        page_dir = (docs_dir / page.file.src_uri).parent
        markdown = _ANY_LINK.sub(lambda m: _outside_link(m, page_dir, docs_dir), markdown)
    return markdown


# ---------------------------------------------------------------------------------------------- API index
def _api_index() -> str:
    rows = "\n".join(f"| [{title}]({module.split('.')[-1]}.md) | `{module}` |" for title, module, _ in _present_api())
    return ("# API reference\n\nGenerated from the docstrings at build time. Everything a user needs is reachable "
            "from `import dspark_hf`:\n\n```python\nimport dspark_hf\n\ndrafter = dspark_hf.DSparkDraftModel."
            "from_pretrained(...)\nout = target.generate(**inputs, assistant_model=drafter)\n"
            "stats = drafter.generation_stats  # DSparkStats\n```\n\n| page | module |\n|---|---|\n" + rows + "\n")


# ---------------------------------------------------------------------------------------------- benchmarks
def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        if len(value) > 16:
            return f"[{len(value)} values]"
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    text = str(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _cell(value) -> str:
    return html.escape(_fmt(value)).replace("|", "\\|").replace("\n", " ")


def _flatten(data, prefix: str = "", depth: int = 0):
    """(dotted key, scalar or short list) leaves; lists of dicts come back whole as ("table", key, rows)."""
    scalar = (str, int, float, bool, type(None))
    if isinstance(data, dict) and len(data) >= 2 and all(
            isinstance(v, dict) and v and all(isinstance(x, scalar) for x in v.values()) for v in data.values()):
        yield ("grid", prefix, [{"": key, **value} for key, value in data.items()])  # e.g. one row per policy
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key), depth + 1)
    elif isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        yield ("table", prefix, data)
    else:
        yield ("value", prefix, data)


def _table(rows: list[dict]) -> list[str]:
    columns = []
    for row in rows:
        for key, value in row.items():
            short = not isinstance(value, (dict, list)) or (isinstance(value, list) and len(value) <= 8)
            if short and key not in columns:
                columns.append(key)
    columns = columns[:10]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows[:40]]
    if len(rows) > 40:
        lines += ["", f"*{len(rows) - 40} more rows in the JSON file.*"]
    return lines


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line if line else "" for line in lines]


def _benchmark_section(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return [f"## {path.stem}", "", f"*Could not read `{path.name}`: {error}*", ""]
    out = [f"## {path.stem}", ""]
    if not isinstance(data, dict):
        return out + [f"*`{path.name}` holds a {type(data).__name__}, not an object.*", ""]
    about = data.get("what") or data.get("benchmark") or data.get("description")
    if about:
        out += [html.escape(str(about)), ""]
    command = data.get("command") or (data.get("environment") or {}).get("command")
    if command:
        out += ["```bash", str(command), "```", ""]
    context = []
    for key in ("machine", "versions", "environment", "date", "date_utc"):
        value = data.get(key)
        if isinstance(value, dict):
            context.append(", ".join(f"{k} {_fmt(v)}" for k, v in value.items() if k != "command"
                                     and not isinstance(v, (dict, list))))
        elif value:
            context.append(_fmt(value))
    if context:
        out += ["*" + html.escape("; ".join(c for c in context if c)) + "*", ""]
    png = path.with_suffix(".png")
    if png.is_file():
        out += [f"![{path.stem}](benchmarks/{png.name})", ""]
    skip = {"command", "what", "benchmark", "description", "machine", "versions", "environment", "date", "date_utc"}
    values, tables, grids = [], [], []
    for kind, key, value in _flatten({k: v for k, v in data.items() if k not in skip}):
        {"table": tables, "grid": grids, "value": values}[kind].append((key, value))
    for key, rows in grids:
        out += [f"**{key or 'results'}**", ""] + _table(rows) + [""]
    if values:
        lines = ["| metric | value |", "|---|---|"] + [f"| `{key}` | {_cell(value)} |" for key, value in values]
        if len(values) > 25:
            out += [f'??? info "{len(values)} values"', ""] + _indent(lines) + [""]
        else:
            out += lines + [""]
    for key, rows in tables:
        out += [f'??? info "{key} ({len(rows)} rows)"', ""] + _indent(_table(rows)) + [""]
    out += [f"Source: `benchmarks/results/{path.name}`", ""]
    return out


def _benchmarks_page() -> str:
    files = sorted(RESULTS.glob("*.json"))
    out = ["# Benchmarks", "",
           "Every benchmark is a script under `benchmarks/` that writes JSON (with the command, machine and versions) "
           "to `benchmarks/results/`; this page renders those files at build time, so it always shows what is "
           "committed. Absolute times come from the machine named in each result; CPU numbers from a shared 2-core "
           "machine only show relative costs. The protocol: τ = accepted drafts + 1 bonus per round, averaged over "
           "rounds; speed = wall-clock tokens/s of DSpark vs plain `generate()` of the same target, same prompts, "
           "same `max_new_tokens`, after warm-up.", ""]
    if not files:
        return "\n".join(out + ["*No results committed yet.*", ""])
    out += ["| result | what |", "|---|---|"]
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        about = data.get("what") or data.get("benchmark") or data.get("description") or "" if isinstance(data, dict) else ""
        out.append(f"| [{path.stem}](#{path.stem.lower().replace('.', '')}) | {_cell(about)} |")
    out.append("")
    for path in files:
        out += _benchmark_section(path)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- errors
def _message(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        return (left or "…") + (right or "…") if left or right else None
    return None


def _error_messages() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name == "ValueError" and node.exc.args:
                    message = _message(node.exc.args[0])
                    if message and message not in found.setdefault(module, []):
                        found[module].append(message)
    return {k: v for k, v in found.items() if v}


def _errors_page() -> str:
    messages = _error_messages()
    total = sum(len(v) for v in messages.values())
    out = ["# Every error message", "",
           f"The {total} `ValueError` messages raised under `src/dspark_hf`, read from the source at build time "
           "(`…` stands for a value filled in at run time). Each names the problem and the fix; "
           "[Troubleshooting](troubleshooting.md) explains the common ones.", ""]
    for module, items in messages.items():
        out += [f"## `{module}`", ""]
        out += [f"- <code>{html.escape(' '.join(m.split()))}</code>" for m in items]
        out.append("")
    return "\n".join(out)
