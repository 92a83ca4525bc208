"""`dspark-hf eval` / `run_evaluation` on a tiny saved pair and local task files."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import saved_pair  # noqa: F401  (fixture)

from dspark_hf.cli import main
from dspark_hf.evaluation import TaskRun, load_task


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(6)))
    (tmp_path / "mtbench").mkdir()
    (tmp_path / "mtbench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"Tell me about {i}", "more"]}) + "\n" for i in range(4)))
    return tmp_path


def test_tasks_follow_the_protocol(data_dir):
    gsm8k = load_task("gsm8k", data_dir, limit=3, seed=1)
    assert len(gsm8k) == 3 and all(p.endswith("within \\boxed{}.") for p in gsm8k)
    assert sorted(load_task("mtbench", data_dir)) == [f"Tell me about {i}" for i in range(4)]  # first turn only
    with pytest.raises(ValueError, match="Unknown task"):
        load_task("nope", data_dir)
    with pytest.raises(ValueError, match="local JSONL|datasets"):
        load_task("livecodebench", data_dir)


def test_summary_metrics_by_hand():
    run = TaskRun(rounds=[(3, 3, 4), (3, 1, 2), (2, 0, 1)], prompts=1)
    summary = run.summary(gamma=3, temperatures=None)
    assert summary["tau"] == pytest.approx(7 / 3)
    assert summary["draft_tokens_per_proposal"] == pytest.approx(8 / 3)
    assert summary["verify_rate"] == pytest.approx(7 / 11)
    assert summary["accept_rate_at_k"] == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert summary["conditional_acceptance"] == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_eval_command_writes_results_and_plots(saved_pair, data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "eval"
    code = main(["eval", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                 "--compare", f"again={saved_pair / 'drafter'}", "--tasks", "gsm8k,mtbench",
                 "--data-dir", str(data_dir), "--num-samples", "3", "--temperature", "0,1.0",
                 "--max-new-tokens", "16", "--threshold-sweep", "0.0,0.9", "--output", str(out), "--device", "cpu"])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    greedy = report["results"]["dspark"]["t0"]["gsm8k"]
    assert greedy["identical_to_plain"] == "3/3" and greedy["tau"] > 1.0 and greedy["speedup"] > 0
    assert len(greedy["conditional_acceptance"]) == 5 and greedy["calibration"]["positions"][0]["count"] > 0
    assert set(report["tau"]) == {"dspark", "again"} and set(report["tau"]["dspark"]) == {"t0", "t1"}
    sweep = report["threshold_sweep"]["dspark"]["gsm8k"]
    assert sweep[0]["draft_tokens_per_proposal"] >= sweep[1]["draft_tokens_per_proposal"]  # a higher bar verifies less
    assert {p.name for p in out.iterdir()} >= {"tau_per_task.png", "conditional_acceptance.png", "threshold_sweep.png"}


def test_round_recorder_matches_dspark_stats_and_reads_classic_assistants():
    from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target

    from dspark_hf.evaluation.harness import RoundRecorder

    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=2))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48), target)
    ids = torch.tensor([[5, 9, 11, 4]])
    with RoundRecorder(target) as recorder:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    stats = drafter.generation_stats
    rounds = recorder.rounds(ids.shape[1], out.shape[1])
    assert rounds[0] == (0, 0, 1)  # the prefill round: no drafts, the first token
    assert rounds[1:] == list(zip(stats.drafted, stats.accepted, stats.committed))

    assistant = tiny_target("llama", vocab_size=48, eos_token_id=2, seed=3)  # a classic independent draft model
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    with RoundRecorder(target) as recorder:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant)
    rounds = recorder.rounds(ids.shape[1], out.shape[1])
    assert sum(c for _, _, c in rounds) == out.shape[1] - ids.shape[1]
    assert all(0 <= a <= d <= 4 and c == a + 1 for d, a, c in rounds[:-1])
