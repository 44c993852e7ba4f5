"""`areal init-model`: write a tiny random-weight model for trying every path on a laptop."""

from __future__ import annotations

from pathlib import Path

import typer

from areal_cli import console
from areal_cli.modelgen import check_target_dir, create_tiny_model, model_summary


def register(app: typer.Typer) -> None:
    @app.command("init-model")
    def init_model(
        directory: Path = typer.Argument(
            ..., metavar="DIR", help="Directory to write the model into."
        ),
        hidden_size: int = typer.Option(
            64, "--hidden-size", help="Hidden size (a multiple of 32)."
        ),
        layers: int = typer.Option(2, "--layers", help="Number of transformer layers."),
        seed: int = typer.Option(0, "--seed", help="Weights are a function of the seed."),
        force: bool = typer.Option(False, "--force", help="Overwrite model files in DIR."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Write a tiny Qwen2-style causal LM (random weights, byte-level tokenizer) to DIR.

        Nothing is downloaded; transformers loads it offline and the hf server serves it on
        a CPU.

        \b
        Examples:
          areal init-model ./tiny
          areal init-model ./tiny-v2 --seed 1    # same shape, other weights
          areal serve --backend hf --model ./tiny
        """
        check_target_dir(directory, force=force)
        path = create_tiny_model(directory, hidden_size=hidden_size, num_layers=layers, seed=seed)
        summary = model_summary(path)
        summary["seed"] = seed
        if as_json:
            console.print_json(summary)
            return
        console.out.print(f"[green]wrote[/] {summary['path']}")
        console.out.print(
            f"  {summary['model_type']}  params {summary['params']:,}  "
            f"vocab {summary['vocab_size']}  hidden {summary['hidden_size']}  "
            f"layers {summary['num_layers']}  seed {seed}"
        )
        console.out.print(f"  files: {', '.join(summary['files'])}", style="dim")
