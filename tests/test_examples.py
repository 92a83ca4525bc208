"""Every example runs: the notebooks under nbclient, the scripts as subprocesses (offline, tiny models, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MPLBACKEND": "Agg", "NO_COLOR": "1"}


def test_examples_exist():
    names = {p.name for p in NOTEBOOKS + SCRIPTS}
    assert {"quickstart.ipynb", "train_your_drafter.ipynb", "calibrate_and_schedule.ipynb",
            "serve_many_requests.py", "push_to_hub.py"} <= names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(notebook, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' temporary folders go with pytest's own
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_script_runs(script, tmp_path):
    env = {**os.environ, **OFFLINE, "TMPDIR": str(tmp_path)}
    env.pop("HF_TOKEN", None)
    result = subprocess.run([sys.executable, str(script), "--output", str(tmp_path / "out")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip()
