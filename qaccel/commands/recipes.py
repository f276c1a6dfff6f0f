"""``qaccel recipes [NAME] [--json]``: the model zoo's recipes, or one recipe's resolved settings."""

from __future__ import annotations

import argparse
import sys

from ._output import emit, format_table, report_usage_error


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recipes", help="list the recipes (model_cards/), or show one recipe's resolved settings")
    parser.add_argument("name", nargs="?", help="a recipe name or a recipe file; omitted: list all recipes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table / YAML")
    parser.set_defaults(func=run)


def model_label(recipe) -> str:
    """A short description of the model: its source, or its type and size when built from config."""
    if recipe.model.name_or_path is not None:
        return recipe.model.name_or_path
    config = recipe.model.config
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    width = config.get("n_embd", config.get("hidden_size"))
    size = f" {layers}L/{width}" if layers is not None and width is not None else ""
    return f"{config['model_type']}{size} (from config)"


def _row(recipe) -> dict[str, str]:
    return {
        "name": recipe.name,
        "task": recipe.task,
        "model": model_label(recipe),
        "method": recipe.method.name,
        "launch": recipe.launch.config,
        "summary": recipe.summary,
    }


def run(args: argparse.Namespace) -> int:
    from ..zoo import list_recipes, load_recipe

    try:
        if args.name is None:
            rows = [_row(r) for r in list_recipes()]
            if args.json:
                emit({"recipes": rows})
            else:
                sys.stdout.write(format_table(rows, ("name", "task", "model", "method", "summary")))
            return 0
        recipe = load_recipe(args.name)
    except (ValueError, RuntimeError) as err:
        return report_usage_error("recipes", err)
    settings = recipe.front_matter()
    if args.json:
        emit({"recipe": settings, "path": str(recipe.path), "launch_config": str(recipe.launch_config_path())})
        return 0
    import yaml

    sys.stdout.write(f"# {recipe.path}\n")
    sys.stdout.write(yaml.safe_dump(settings, sort_keys=False, default_flow_style=False, width=120))
    return 0
