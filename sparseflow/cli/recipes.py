"""``sparseflow recipes``: list the shipped recipes (see :mod:`sparseflow.recipes`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    rec = sub.add_parser("recipes", help="list the shipped recipes")
    rec.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..recipes import get_recipe, list_recipes

    for name in list_recipes():
        r = get_recipe(name)
        print(f"{name}: {r.description}")
        print(f"    model types {list(r.model_types)}, dense layers {list(r.dense_layers)}")
        for m in r.methods:
            print(f"    {m}: {r.configs[m].to_json()}")
        for tokens, band in r.longer:
            print(f"    from {tokens} keys ({band.name}): dense layers {list(band.dense_layers)}")
            for m in band.methods:
                print(f"        {m}: {band.configs[m].to_json()}")
    return 0
