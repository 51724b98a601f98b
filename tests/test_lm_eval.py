"""lm-evaluation-harness scores a served model exactly as it scores the same model in-process.

A worker serves a tiny float32 Llama that transformers loads too. lm-eval's
`local-completions` backend evaluates it over HTTP with its default tokenizer setting,
which finds the worker's remote tokenizer endpoints (no local tokenizer files); its
Hugging Face backend evaluates the same directory in-process. Two tasks are written
here, with their data in tests/data/lm_eval (nothing is downloaded): a multiple-choice
loglikelihood task (echo + prompt logprobs) and a generate_until task.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Worker, start_worker, stop_worker

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data" / "lm_eval"
# Per-document log-likelihoods of the two backends agree to float32 summation order (the
# worker and transformers add the same products in different orders: ~1e-5 per logit over
# a few tokens). Allowing 2e-3 per document, a choice can only flip between backends when
# two choices are closer than that, so the accuracies may differ by at most the share of
# such near-tied documents.
LOGLIKELIHOOD_ATOL = 2e-3

CHOICE_TASK = """
task: llorch_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GENERATE_TASK = """
task: llorch_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/generate.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def llama_worker(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    live = start_worker(tmp_path_factory.mktemp("lm-eval"), "--model", str(zoo["llama"]))
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "choice.yaml").write_text(CHOICE_TASK.format(data=DATA))
    (folder / "generate.yaml").write_text(GENERATE_TASK.format(data=DATA))
    return folder


def evaluate(model: str, model_args: dict[str, Any], tasks: Path) -> dict[str, Any]:
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["llorch_choice", "llorch_generate"],
                           task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def by_doc(results: dict[str, Any], task: str) -> dict[int, Any]:
    return {sample["doc_id"]: sample for sample in results["samples"][task]}


def test_lm_eval_over_http_equals_its_hugging_face_backend(llama_worker: Worker, zoo: dict[str, Path], tasks: Path,
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with llama_worker.client() as http:
        model_id = http.get("/v1/models").json()["data"][0]["id"]
    served = evaluate("local-completions", {
        "base_url": f"{llama_worker.base_url}/v1/completions", "model": model_id, "batch_size": 4,
        "max_retries": 1}, tasks)
    # lm-eval's API backends send token ids without BOS (its remote tokenizer asks for no special
    # tokens); the worker puts the model's BOS in front, as the model's tokenizer would. Its Hugging
    # Face backend, told to add BOS, sees the same token ids:
    local = evaluate("hf", {"pretrained": str(zoo["llama"]), "dtype": "float32", "device": "cpu",
                            "add_bos_token": True}, tasks)

    # Multiple choice: every choice's log-likelihood, then the accuracy.
    served_docs, local_docs = by_doc(served, "llorch_choice"), by_doc(local, "llorch_choice")
    assert served_docs.keys() == local_docs.keys() and len(served_docs) == 16
    near_ties = 0
    for doc_id, sample in served_docs.items():
        ours = [float(r[0]) for r in sample["filtered_resps"]]
        theirs = [float(r[0]) for r in local_docs[doc_id]["filtered_resps"]]
        assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_ATOL), doc_id
        ranked = sorted(theirs, reverse=True)
        near_ties += ranked[0] - ranked[1] < 2 * LOGLIKELIHOOD_ATOL
    served_acc = served["results"]["llorch_choice"]["acc,none"]
    local_acc = local["results"]["llorch_choice"]["acc,none"]
    assert abs(served_acc - local_acc) <= near_ties / len(served_docs)

    # Generation: greedy text, cut at the same stop sequence, scored the same way.
    served_gen, local_gen = by_doc(served, "llorch_generate"), by_doc(local, "llorch_generate")
    assert served_gen.keys() == local_gen.keys() and len(served_gen) == 8
    texts = {doc_id: (s["filtered_resps"][0], local_gen[doc_id]["filtered_resps"][0])
             for doc_id, s in served_gen.items()}
    # Greedy decoding can only part where two logits tie to ~1e-5; allow one such document of eight.
    differing = [pair for pair in texts.values() if pair[0] != pair[1]]
    assert len(differing) <= 1, json.dumps(texts, ensure_ascii=False)
    assert any(ours for ours, _ in texts.values())  # it really generated
    served_em = served["results"]["llorch_generate"]["exact_match,none"]
    local_em = local["results"]["llorch_generate"]["exact_match,none"]
    assert abs(served_em - local_em) <= len(differing) / len(served_gen)


def test_generate_until_with_default_settings_answers_as_the_text_prompt_does(
        worker: Worker, tasks: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """lm-eval sends generation prompts as token ids without BOS; the default model (Gemma, which
    needs BOS first) must answer them as it answers the same question sent as text."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    with worker.client() as http:
        model_id = http.get("/v1/models").json()["data"][0]["id"]
        served = simple_evaluate(
            model="local-completions", model_args={"base_url": f"{worker.base_url}/v1/completions",
                                                   "model": model_id, "batch_size": 4, "max_retries": 1},
            tasks=["llorch_generate"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
        answers = by_doc(served, "llorch_generate")
        docs = [json.loads(line) for line in (DATA / "generate.jsonl").read_text().splitlines() if line]
        for doc_id, sample in answers.items():
            as_text = http.post("/v1/completions", json={
                "model": model_id, "prompt": docs[doc_id]["question"], "max_tokens": 8, "temperature": 0,
                "stop": ["\n"]}).json()["choices"][0]["text"]
            assert sample["filtered_resps"][0] == as_text, doc_id
    assert sum(bool(sample["filtered_resps"][0].strip()) for sample in answers.values()) >= len(answers) - 1
