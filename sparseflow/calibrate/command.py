"""``sparseflow calibrate``: check the command's arguments, load the model and its real-text
tokens, calibrate, and write the recipe file (:func:`calibrate_file`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

from ..config import default_config
from ..convert import check_architecture, load_config, load_source, parse_config, resolve_source
from ..eval.evaluate import model_device
from ..gguf_once import gguf_parsed_once
from ..rope import parse_rope_scaling, set_rope_scaling
from .choices import candidate_choices, sparse_spec
from .run import DEFAULT_MARGIN, CalibrationResult, calibrate, check_budget, check_share
from .texts import DEFAULT_HELDOUT_TEXT, DEFAULT_TEXT, check_disjoint, kind_summary, parse_texts, text_tokens


def side_paths(out) -> Tuple[Path, Path]:
    """(progress file, dense-logits cache folder) kept next to the recipe file ``out``."""
    out = Path(out).expanduser()
    return out.with_name(out.name + ".progress.json"), out.with_name(out.name + ".cache")


def parse_values(text: Optional[str], kind, arg: str) -> Optional[Tuple]:
    """A comma list of ``kind`` values from the command line (None when not given)."""
    if text is None:
        return None
    try:
        out = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{arg} must be a comma list of {kind.__name__} values, got {text!r}") from None
    if not out:
        raise ValueError(f"{arg} must name at least one value, got {text!r}")
    return out


@gguf_parsed_once()  # one header parse for the config check and the load
def calibrate_file(
    model_path,
    out,
    *,
    method: str,
    kl_budget: float,
    tokens: int = 2048,
    eval_positions: int = 512,
    text: str = DEFAULT_TEXT,
    heldout_text: Optional[str] = DEFAULT_HELDOUT_TEXT,
    config=None,
    thresholds=None,
    top_ks=None,
    scorings=None,
    safety: float = 0.8,
    margin: float = DEFAULT_MARGIN,
    cost: str = "auto",
    backend: str = "auto",
    dtype: str = "auto",
    tokenizer=None,
    rope_scaling=None,
    cache_dir=None,
    name: Optional[str] = None,
    say: Optional[Callable[[str], None]] = None,
    device=None,
    prune: bool = True,
) -> CalibrationResult:
    """``sparseflow calibrate``: load ``model_path`` (HF folder, GGUF file or converted folder, run
    dense), calibrate on ``tokens`` tokens of each text of ``text`` (a comma list of shipped texts:
    a mix holds the KL constraint on its worst text, :mod:`.mix`), check on each of
    ``heldout_text`` (a comma list, none of them calibrating) and write the recipe to ``out``
    atomically. Everything checkable is checked before the weights load.
    ``device``: where the model runs (None: where it loads, the CPU). ``prune``: see :func:`calibrate`."""
    budget = check_budget(kl_budget)
    check_share(safety, "safety")
    check_share(margin, "margin")
    _check_file_args(method, text, heldout_text, rope_scaling)
    source = resolve_source(model_path)
    model_config = load_config(source)
    check_architecture(model_config)  # calibrate runs the plans through the attention interface as well
    base = parse_config(method, config) or default_config(method)
    choices = candidate_choices(method, base, thresholds=thresholds, top_ks=top_ks, scorings=scorings)
    progress_path, default_cache = side_paths(out)
    say = say or (lambda msg: None)
    model, tok, rope_info = load_model(source, model_path, dtype, device, tokenizer, rope_scaling, say, model_config)
    ids, heldout = calibration_tokens(model, tok, tokens, text, heldout_text)
    say(
        f"{len(choices)} choice(s) + dense for each of {model.config.num_hidden_layers} layers; "
        f"{tokens} tokens of {', '.join(ids)}, KL over the last {eval_positions} positions; progress in {progress_path}"
    )
    t0 = time.perf_counter()
    result = calibrate(
        model,
        ids,
        method,
        budget,
        base=base,
        eval_positions=eval_positions,
        heldout_ids=heldout,
        choices=choices,
        safety=safety,
        margin=margin,
        cost=cost,
        backend=backend,
        progress_path=progress_path,
        cache_dir=cache_dir if cache_dir is not None else default_cache,
        name=name,
        say=say,
        prune=prune,
        extra={
            "model": str(source),
            "rope_scaling": rope_info,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    )
    seconds = time.perf_counter() - t0
    recipe = dataclasses.replace(result.recipe, measured={**result.recipe.measured, "seconds": seconds})
    recipe.save(out)
    result.recipe = recipe
    say(_summary(result, out, seconds))
    return result


def _check_file_args(method: str, text: str, heldout_text: Optional[str], rope_scaling) -> None:
    """The command's checks that need no file: method, texts, RoPE scaling."""
    sparse_spec(method, "--method")
    if text is None:
        raise ValueError("--text must name at least one calibration text (a comma list of shipped texts)")
    check_disjoint(parse_texts(text, "--text"), parse_texts(heldout_text, "--heldout-text"), "--heldout-text")
    try:
        parse_rope_scaling(rope_scaling)
    except ValueError as exc:
        raise ValueError(f"--rope-scaling: {exc}") from None


def load_model(
    source, model_path, dtype: str, device, tokenizer, rope_scaling, say: Callable[[str], None], model_config=None
):
    """``(model, tokenizer, RoPE scaling applied)`` of a resolved source (``model_config``: its
    config, when read already)."""
    say(f"loading {source} ...")
    model, tok = load_source(source, dtype=dtype, device=device, config=model_config)
    say(f"weights in {next(model.parameters()).dtype} on {device or 'cpu'}")
    if device is not None:
        model.to(device)
    if tokenizer is not None:
        from transformers import AutoTokenizer  # optional dependency (sparseflow[hf]): imported once a model loads

        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    if tok is None:
        raise ValueError(f"{model_path} has no tokenizer; pass --tokenizer PATH")
    rope_info = None if rope_scaling is None else set_rope_scaling(model, rope_scaling)
    return model, tok, rope_info


def calibration_tokens(model, tok, tokens: int, text: str, heldout_text: Optional[str]):
    """``(calibration tokens, held-out tokens or None)`` on the model's device, each a dict of text
    name to ``[1, tokens]`` ids; ``text`` and ``heldout_text`` are comma lists of shipped texts."""
    on = model_device(model)
    ids = text_tokens(tok, tokens, parse_texts(text, "--text"), "--tokens", on)
    if heldout_text is None:
        return ids, None
    return ids, text_tokens(tok, tokens, parse_texts(heldout_text, "--heldout-text"), "--tokens (held-out text)", on)


def _summary(result: CalibrationResult, out, seconds: float) -> str:
    """The command's last line: what was written, and the fidelity measured."""
    c, h = result.calibration, result.heldout
    line = (
        f"wrote {out} in {seconds:.0f} s: {len(result.recipe.dense_layers)} dense layer(s); calibration KL "
        f"{c['mean_kl']:.5f}, top-1 {c['top1']:.3f}, density {c['density']:.3f}"
    )
    if len(c["texts"]) > 1:
        line += f" (worst text {c['worst_text']}; {kind_summary(c)})"
    if h is not None and len(h["texts"]) == 1:
        line += f"; held-out {kind_summary(h)}"
    elif h is not None:
        line += f"; held-out KL {h['mean_kl']:.5f} (worst text {h['worst_text']}; {kind_summary(h)})"
    single = result.recipe.measured.get("single_layer")
    if single:
        line += f"; {single['summary']}"
    return line
