"""The real 50M code model from ../shared/fixtures as target, with a random-init DSpark drafter (skips without it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import shared_path
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf

pytestmark = pytest.mark.fixtures

CODE_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
]


@pytest.fixture(scope="module")
def code50m(tmp_path_factory):
    script = shared_path("fixtures", "materialize.py")
    folder = tmp_path_factory.mktemp("code50m")
    subprocess.run([sys.executable, str(script), "code-llama-50m", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_code50m_greedy_matches_plain(code50m, head_type):
    tokenizer, target = code50m
    torch.manual_seed(0)
    config = dspark_hf.DSparkConfig.from_target_config(
        target.config, mask_token_id=0, num_hidden_layers=2, markov_rank=16, markov_head_type=head_type, block_size=7
    )
    drafter = dspark_hf.DSparkDraftModel(config).eval()
    drafter.weights_from_target = {"embed_tokens", "lm_head"}
    for prompt in CODE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        reference = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, reference), tokenizer.decode(out[0])
        assert drafter.generation_stats.rounds > 0
    assert drafter.embed_tokens.weight is target.get_input_embeddings().weight
