"""``sparseflow convert``: turn a third-party checkpoint into a Hugging Face folder that runs
sparse attention when reloaded.

The output is a standard ``save_pretrained`` folder (weights, tokenizer when the source has one)
whose ``config.json`` carries ``"attn_implementation": "sparseflow"`` and a ``"sparseflow"``
entry: the per-layer :class:`sparseflow.hf.Plan` (method, config dict, backend, dense layers,
per-layer configs, recipe, source). Reload it with::

    import sparseflow.hf
    sparseflow.hf.register()                      # once per process
    model = AutoModelForCausalLM.from_pretrained(out_dir)

or ``sparseflow.hf.from_pretrained(out_dir)``. ``attn_implementation="sdpa"`` loads it dense.

The folder is written into a temporary sibling directory and renamed into place at the end, so
a failure (or Ctrl-C) never leaves a half-written ``out_dir``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from .config import AttentionConfig, config_from_dict, default_config
from .gguf_once import gguf_parsed_once
from .methods import sparse_names

__all__ = [
    "ConversionError",
    "check_architecture",
    "Source",
    "resolve_source",
    "build_plan",
    "load_config",
    "parse_config",
    "load_source",
    "convert",
]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConversionError(ValueError):
    """A checkpoint or setting that ``convert`` cannot handle; the message says what and why."""


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" or "gguf"
    folder: Path
    gguf_file: Optional[str] = None

    def __str__(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)

    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _say(progress: Optional[Callable[[str], None]], msg: str) -> None:
    if progress is not None:
        progress(msg)


def resolve_source(src: Union[str, os.PathLike]) -> Source:
    """Classify ``src``: a GGUF file, a folder holding one GGUF file, or a HF model folder
    (``config.json`` + safetensors/bin weights). Raises FileNotFoundError naming what is missing."""
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"source {str(src)!r} does not exist (expected a Hugging Face model folder or a .gguf file)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConversionError(
                f"source file {str(src)!r} is not a .gguf file; pass a GGUF file or a Hugging Face model folder"
            )
        return Source("gguf", path.resolve().parent, path.name)
    has_config = (path / "config.json").is_file()
    weights = [f for f in _WEIGHT_FILES if (path / f).is_file()]
    weights += sorted(p.name for p in path.glob("*.safetensors") if p.name not in weights)
    if has_config and weights:
        return Source("hf", path.resolve())
    ggufs = sorted(path.glob("*.gguf"))
    if not has_config and len(ggufs) == 1:
        return Source("gguf", path.resolve(), ggufs[0].name)
    if not has_config and len(ggufs) > 1:
        raise ConversionError(f"{str(src)!r} holds several .gguf files ({[g.name for g in ggufs]}); pass one of them")
    missing = []
    if not has_config:
        missing.append("config.json")
    if not weights:
        missing.append("weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")
    raise FileNotFoundError(f"{str(src)!r} is not a Hugging Face model folder: missing {' and '.join(missing)}")


def _check_gguf(path: Path) -> None:
    """Name an unreadable GGUF file as such (transformers would report its broken metadata as an
    invalid config file): the magic first, then the whole header through the gguf reader."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ConversionError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers needs gguf to load the file and says so itself
        return
    try:
        GGUFReader(str(path))
    except Exception as exc:  # the reader raises several types for a corrupt or truncated header
        raise ConversionError(
            f"{str(path)!r} is a corrupt or truncated GGUF file: reading its header failed "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


@gguf_parsed_once()
def load_config(source: Source):
    """The transformers config of a resolved source (no weights load); ConversionError if unreadable."""
    from transformers import AutoConfig

    if source.kind == "gguf":
        _check_gguf(source.folder / source.gguf_file)
    try:
        return AutoConfig.from_pretrained(str(source.folder), **source.load_kwargs())
    except Exception as exc:  # transformers raises many types for unreadable/unsupported configs
        raise ConversionError(f"cannot read the model configuration of {source}: {exc}") from exc


def check_architecture(model_config) -> None:
    """Refuse, from the config alone (no weights load), a model sparseflow cannot run: one with no
    transformers causal-LM class, an encoder or encoder-decoder, or a class whose attention does not
    go through transformers' attention interface with SDPA's semantics. The ConversionError names
    the model type, the class and what it lacks."""
    model_type = getattr(model_config, "model_type", None)
    cls = _causal_lm_class(model_config)
    missing = _missing_capabilities(model_config, cls)
    if not missing:
        return
    hint = ""
    if missing == [_NO_INTERFACE]:  # its SDPA calls are still there for sparseflow.compile to rewrite
        hint = "; sparseflow.compile(model, ...) still rewrites its SDPA calls once it is loaded"
    raise ConversionError(
        f"unsupported architecture: model_type={model_type!r} ({cls.__name__}): {'; '.join(missing)}{hint}"
    )


def _causal_lm_class(model_config):
    """The class AutoModelForCausalLM instantiates for ``model_config`` (imports its module only)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        archs = getattr(model_config, "architectures", None)
        raise ConversionError(
            f"unsupported architecture: model_type={getattr(model_config, 'model_type', None)!r}"
            f"{f' ({archs})' if archs else ''} has no causal-LM class in transformers "
            "(AutoModelForCausalLM cannot load it); sparseflow runs decoder LMs"
        ) from None
    if isinstance(cls, (tuple, list)):  # several classes share the config: the one its checkpoint names
        named = [c for c in cls if c.__name__ in (getattr(model_config, "architectures", None) or ())]
        cls = (named or list(cls))[0]
    return cls


def _not_a_decoder(model_config) -> Optional[str]:
    """Why the config is no decoder LM (None when it is one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(model_config, "is_encoder_decoder", False):
        return "it is an encoder-decoder (is_encoder_decoder=True), not a decoder-only LM"
    # BERT and its kin carry is_decoder (False: bidirectional attention) and have a masked-LM head; a
    # decoder LM has no masked-LM head (gpt_neox carries an unused is_decoder=False)
    if (
        getattr(model_config, "is_decoder", None) is False
        and getattr(model_config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        return "it is an encoder (is_decoder=False: every token attends to every other), not a causal LM"
    return None


def _multimodal(model_config, cls) -> Optional[str]:
    # a class built on the whole of a config that has a text_config runs other towers (vision,
    # audio) through the same attention interface, where a causal LM's sparse plan has no meaning;
    # AutoModelForCausalLM builds a text-only class on the text_config itself (llama4, mllama)
    text_config = (getattr(model_config, "sub_configs", None) or {}).get("text_config")
    if text_config is not None and getattr(cls, "config_class", None) is not text_config:
        return "it is a multimodal model (it holds a text_config), not a text decoder LM"
    return None


_NO_INTERFACE = (
    "transformers does not mark it as running its attention and masks through custom attention "
    "functions (_supports_attention_backend is False), the way sparseflow runs as "
    "attn_implementation='sparseflow'"
)


def _missing_capabilities(model_config, cls) -> list:
    """Why sparseflow cannot run the class (none: it can), from the config and the class's flags."""
    missing = []
    not_an_lm = _not_a_decoder(model_config) or _multimodal(model_config, cls)
    if not_an_lm:
        missing.append(not_an_lm)
    # the flag transformers sets on models that route attention *and* masks through its
    # AttentionInterface / AttentionMaskInterface: how attn_implementation="sparseflow" plugs in
    if not cls._supports_attention_backend:
        missing.append(_NO_INTERFACE)
    # sparseflow's ops compute what SDPA computes: a class without SDPA support does more
    # (logit soft-capping, attention sinks), which an attention function would silently drop
    if not cls._supports_sdpa:
        missing.append(
            "transformers does not run its attention as SDPA (_supports_sdpa is False: it adds e.g. "
            "logit soft-capping or attention sinks), and sparseflow's ops compute what SDPA computes"
        )
    return missing


def _parse_layers(layers: Union[None, str, Iterable[int]]) -> Optional[tuple]:
    if layers is None:
        return None
    if isinstance(layers, str):
        items = [s.strip() for s in layers.split(",") if s.strip()]
        try:
            return tuple(int(s) for s in items)
        except ValueError:
            raise ConversionError(f"dense layers must be a comma list of layer indices, got {layers!r}") from None
    return tuple(layers)


def _config_fields(config) -> Optional[dict]:
    """The fields a config given as JSON, a JSON file or a dict sets (None for a config object)."""
    if config is None or isinstance(config, AttentionConfig):
        return None
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        config = Path(config).read_text()
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ConversionError(f"config must be JSON (or a JSON file): {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"config must be a JSON object, got {type(config).__name__}")
    return dict(config)


def _config_over(base: AttentionConfig, config, method: str) -> AttentionConfig:
    """``base`` (a recipe's config) with the fields ``config`` sets replaced; a config object
    replaces it whole."""
    fields = _config_fields(config)
    if fields is None:
        return parse_config(method, config) or base
    return parse_config(method, {**base.to_dict(), **fields, "method": fields.get("method", method)})


def parse_config(method: str, config) -> Optional[AttentionConfig]:
    """``config`` (None, a config object, a dict, JSON text or a JSON file) as a config of ``method``;
    None stays None. ConversionError for a bad one or one of another method."""
    if config is None or isinstance(config, AttentionConfig):
        cfg = config
    else:
        config = _config_fields(config)
        config.setdefault("method", method)
        try:
            cfg = config_from_dict(config)
        except (TypeError, ValueError) as exc:
            raise ConversionError(f"bad config: {exc}") from exc
    if cfg is not None and cfg.method != method:
        raise ConversionError(f"config is for method {cfg.method!r} but method={method!r}")
    return cfg


def _plan_recipe(spec, model_config, method: str):
    """The recipe ``spec`` names (a shipped name, a .json file, "auto" or None), checked against
    the model and ``method``; "auto" gives None when no shipped recipe fits or covers ``method``."""
    from .recipes import RecipeError, resolve_recipe

    rec = resolve_recipe(spec, model_config)
    if rec is None:
        return None
    auto = isinstance(spec, str) and spec.strip().lower() == "auto"
    if auto and method not in rec.configs:
        return None
    rec = rec.fitted(model_config)
    if method not in rec.configs:
        raise RecipeError(f"recipe {rec.label!r} has no {method!r} settings; it covers {rec.methods}")
    return rec


def build_plan(
    model_config,
    method: str,
    *,
    recipe: Optional[str] = None,
    config=None,
    dense_layers=None,
    backend: str = "auto",
    source: Optional[str] = None,
):
    """The :class:`sparseflow.hf.Plan` for a model: the recipe's (a shipped name, a recipe .json
    file or "auto"; checked against the model) or the method's defaults, with ``config`` and
    ``dense_layers`` overriding. ``config`` given as a dict or JSON changes only the fields it
    names (over a recipe's config too); a config object replaces the recipe's whole."""
    from .recipes import RecipeError

    if method not in sparse_names():
        raise ConversionError(f"method must be one of {list(sparse_names())}, got {method!r}")
    if backend not in ("auto", "reference", "triton", "flex"):
        raise ConversionError(f"backend must be one of ['auto', 'reference', 'triton', 'flex'], got {backend!r}")
    check_architecture(model_config)
    n_layers = getattr(model_config, "num_hidden_layers", None)
    user_dense = _parse_layers(dense_layers)
    try:
        rec = _plan_recipe(recipe, model_config, method)
    except RecipeError as exc:
        raise ConversionError(f"bad recipe: {exc}") from exc
    band = functools.partial(
        _band_plan,
        method=method,
        config=config,
        dense_layers=user_dense,
        backend=backend,
        source=source,
        n_layers=n_layers,
    )
    if rec is None:
        return band(None)
    return band(rec, longer=tuple((tokens, band(r)) for tokens, r in rec.bands_for(method)))


def _band_plan(rec, *, method, config, dense_layers, backend, source, n_layers, longer=()):
    """The plan of one recipe (or of the method's defaults when ``rec`` is None) with the user's
    ``config`` and ``dense_layers`` over it; ``longer``: the bands for longer prompts, built alike."""
    from .hf import Plan
    from .recipes import RecipeError

    dense = dense_layers
    if rec is not None:
        # fields given as JSON or a dict change the recipe's config (not the defaults'); a config
        # object replaces it
        cfg = _config_over(rec.config_for(method), config, method)
        dense = rec.dense_layers if dense is None else dense
    else:
        cfg = parse_config(method, config) or default_config(method)
    dense = tuple(sorted(set(dense or ())))
    if n_layers is not None:
        bad = [i for i in dense if not (0 <= i < n_layers)]
        if bad:
            raise ConversionError(
                f"dense layers {bad} out of range: the model has {n_layers} layers (0..{n_layers - 1})"
            )
    per_layer = {}
    if rec is not None:
        # the recipe's per-layer changes apply on top of whichever config is used; a layer the
        # caller made dense stays dense
        try:
            per_layer = {i: c for i, c in rec.layer_configs_for(method, cfg, n_layers).items() if i not in dense}
        except RecipeError as exc:
            raise ConversionError(f"bad recipe: {exc}") from exc
    try:
        return Plan(
            method=method,
            config=cfg,
            backend=backend,
            dense_layers=dense,
            layer_configs=per_layer,
            recipe=None if rec is None else rec.label,
            num_layers=n_layers,
            source=source,
            longer=longer,
        )
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"bad plan: {exc}") from exc


@gguf_parsed_once()
def load_source(source: Source, *, dtype: str = "auto", attn_implementation: str = "sdpa", device=None, config=None):
    """(model, tokenizer or None) of a source, offline, in eval mode. ``device``: where the model
    will run (only read by ``dtype="auto"``). ``config``: the source's config when the caller has
    read it already (:func:`load_config`): a GGUF file is then parsed once less (its tokenizer
    vocabulary makes each parse seconds long)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        # HF folders keep their dtype. GGUF weights are dequantised to fp32 by transformers: kept
        # on the CPU, bf16 on CUDA, the dtype a GPU serves them in (fp32 there would make every
        # timing and fidelity figure fp32's: IEEE-fp32 kernels, another SDPA backend)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        torch_dtype = (torch.bfloat16 if on_cuda else torch.float32) if source.kind == "gguf" else "auto"
    else:
        torch_dtype = getattr(torch, dtype)
    kw = source.load_kwargs()
    try:
        if config is not None:
            kw["config"] = copy.deepcopy(config)  # the loaded model's to change, not the caller's
        model = AutoModelForCausalLM.from_pretrained(
            str(source.folder), dtype=torch_dtype, attn_implementation=attn_implementation, **kw
        )
    except Exception as exc:
        raise ConversionError(f"cannot load the model from {source}: {type(exc).__name__}: {exc}") from exc
    if source.kind == "gguf":
        _drop_gguf_quantizer(model)
    try:
        tok = AutoTokenizer.from_pretrained(str(source.folder), **kw)
    except Exception:  # no tokenizer files: the converted folder has none either
        tok = None
    return model.eval(), tok


def _drop_gguf_quantizer(model) -> None:
    # transformers dequantises GGUF tensors to plain torch tensors on load but keeps a "gguf"
    # quantizer attached, which refuses save_pretrained; the weights are ordinary, so drop it.
    q = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(q, "quantization_config", None), "quant_method", None)
    if q is not None and str(getattr(method, "value", method)).lower() == "gguf":
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            try:
                model.is_quantized = False
            except AttributeError:
                pass
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"output {str(out)!r} exists and is not a folder")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(
                f"output folder {str(out)!r} exists and is not empty; pass --force (overwrite=True) to replace it"
            )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(
            f"cannot create the folder {str(out.parent)!r} for output {str(out)!r}: "
            f"{exc.strerror or exc}; pass an output path in a folder you can write"
        ) from None


def _make_tmp(out: Path) -> Path:
    """The temporary sibling the folder is written into (renamed into place at the end); made
    before the weights load, so an unwritable output fails in seconds, not after the load."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.sparseflow-", dir=str(out.parent)))
    except OSError as exc:
        raise ConversionError(
            f"cannot write into {str(out.parent)!r} (for output {str(out)!r}): "
            f"{exc.strerror or exc}; pass an output path in a folder you can write"
        ) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary folder
    return tmp


def _swap_into_place(tmp: Path, out: Path) -> None:
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=str(out.parent)))
    old.rmdir()
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:  # interrupted between the two renames: put the old output back
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@gguf_parsed_once()  # one header parse for the check, the config, the tokenizer and the weights
def convert(
    src: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    method: str = "pbs",
    *,
    recipe: Optional[str] = None,
    config=None,
    dense_layers=None,
    backend: str = "auto",
    dtype: str = "auto",
    overwrite: bool = False,
    progress: Optional[Callable[[str], None]] = None,
) -> Path:
    """Convert ``src`` (HF folder or GGUF file) into the HF folder ``out`` running ``method``.
    Returns ``out``. Checks everything it can before loading weights; writes atomically: the
    temporary folder is removed on any exception, Ctrl-C, or SIGTERM when the caller turns it into
    an exception (the ``sparseflow`` command does)."""
    source = resolve_source(src)
    out = Path(out).expanduser()
    _prepare_out(out, overwrite)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    t0 = time.perf_counter()
    tmp = _make_tmp(out)
    try:
        _say(progress, f"[1/4] reading the configuration of {source} ({source.kind})")
        model_config = load_config(source)
        plan = build_plan(
            model_config,
            method,
            recipe=recipe,
            config=config,
            dense_layers=dense_layers,
            backend=backend,
            source=str(source),
        )
        _say(
            progress,
            f"      {model_config.model_type}, {plan.num_layers} layers; method {plan.method}, "
            f"dense layers {list(plan.dense_layers)}{f', recipe {plan.recipe}' if plan.recipe else ''}",
        )
        _say(progress, "[2/4] loading the weights" + (" (dequantising GGUF)" if source.kind == "gguf" else ""))
        model, tok = load_source(source, dtype=dtype, config=model_config)
        _say(progress, "[3/4] writing the Hugging Face folder")
        model.save_pretrained(str(tmp))
        if tok is not None:
            tok.save_pretrained(str(tmp))
        else:
            _say(progress, "      note: the source has no tokenizer; the output has none either")
        cfg_path = tmp / "config.json"
        data = json.loads(cfg_path.read_text())
        data["attn_implementation"] = "sparseflow"
        data["sparseflow"] = plan.to_dict()
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        from .hf import Plan

        Plan.from_dict(json.loads(cfg_path.read_text())["sparseflow"])  # round-trips
        _say(progress, f"[4/4] moving it into place: {out}")
        if out.exists():
            _swap_into_place(tmp, out)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"done in {time.perf_counter() - t0:.1f} s; load with sparseflow.hf.from_pretrained({str(out)!r})")
    return out


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
