"""A user's GRPO script on AReaL's public API (PPOTrainer, RLVRWorkflow, load_expr_config),
run by the `areal` tier through `areal train --areal-overrides` as any AReaL user's would be.

    python gsm8k_driver.py --config cfg.yaml [key=value ...]

The dataset is a JSONL file of GSM8K-style rows ({"question", "answer"}) at
train_dataset.path. The reward is one a random model earns part of (the share of plain-ASCII
tokens in its answer, plus 1 for the right number), so the gradient is not zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    # The tiny model's tokenizer has one token per byte: a random model writes plain ASCII
    # (ids below 128) about half the time, so every group's rewards differ.
    ids = list(completion_ids or [])
    ascii_share = sum(1 for t in ids if t < 128) / max(1, len(ids))
    return ascii_share + (1.0 if answer and str(answer) in (completions or "") else 0.0)


def rows(path: str) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            messages = [{"role": "user", "content": row["question"]}]
            out.append({"messages": messages, "answer": row["answer"]})
    return out


def main(argv: list[str]) -> None:
    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config
    from datasets import Dataset

    config, _ = load_expr_config(argv, GRPOConfig)
    train = Dataset.from_list(rows(config.train_dataset.path))
    with PPOTrainer(config, train_dataset=train) as trainer:
        trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=dict(
                reward_fn=f"{Path(__file__).stem}.reward",
                gconfig=config.gconfig,
                tokenizer=config.tokenizer_path,
            ),
        )


if __name__ == "__main__":
    main(sys.argv[1:])
