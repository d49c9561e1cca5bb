"""Calibration on a mix of texts (prose, code, copy-heavy; ``--text a,b,c``): one :class:`Session`
per text, every choice's cost, every single-layer choice and every whole plan measured on each
text, the results combined so that the plan's KL constraint holds on the worst text.

Why the worst text and not the mean: the plan must hold on every kind of text it serves, and a
mean lets a text the plan suits hide one it does not (prose at 0.4x the budget and copy-heavy
text at 1.6x average to 1.0x). So a choice's single-layer KL is its largest over the texts (the
walk's prediction of the worst text's KL, an upper bound of each text's own sum) and a whole
plan's measured KL is its largest over the texts; the cost being compute, a choice's cost and a
plan's density are their means over the texts. One text is a mix of one: every combination is
that text's own numbers, and its progress file keeps the one-text form."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Sequence

import torch

from ..eval.evaluate import dense_logits
from ..hf import local_windows
from . import costs as _costs
from . import measure as _measure  # looked up at call time: a test patches measure_entry's measure_layer there
from .choices import Choice, Measurement
from .inputs import layer_inputs
from .progress import Progress, progress_key
from .session import Session, plan_of_choices

# what a text's own entry under "texts" keeps of its whole-plan fidelity
PER_TEXT = ("mean_kl", "p99_kl", "top1", "density", "ppl_dense", "ppl_sparse", "tokens")


@dataclass
class Mix:
    """The calibration texts' sessions (same model, method, base config, positions and grid)."""

    sessions: Dict[str, Session]  # text name -> its session, in the order given
    kinds: Dict[str, str]  # text name -> its kind (sparseflow.texts.KINDS, or "other")

    @property
    def first(self) -> Session:
        return next(iter(self.sessions.values()))

    @property
    def n_layers(self) -> int:
        return self.first.n_layers

    @property
    def windows(self):
        return self.first.windows

    def layer_choices(self, layer: int, choices: Sequence[Choice]) -> List[Choice]:
        return self.first.layer_choices(layer, choices)

    def store(self, progress: Progress, text: str):
        """Where ``text``'s own measurements are kept: the file's top level for one text, else its section."""
        return progress if len(self.sessions) == 1 else progress.section(text)


def open_mix(model, ids: Mapping[str, torch.Tensor], kinds: Mapping[str, str], cache_dir, say, **shared) -> Mix:
    """A :class:`Mix` of one session per text: the dense logits of its last ``shared["keep"]``
    positions (cached in ``cache_dir``) and, from one dense pass, the hidden state entering every
    layer; ``shared``: the fields every session has alike (keep, method, base, backend, cost)."""
    windows = local_windows(model.config)
    sessions = {}
    for text, input_ids in ids.items():
        say(f"dense pass on {text}: logits and every layer's input ({input_ids.shape[1]} tokens)")
        dense = dense_logits(model, input_ids, shared["keep"], cache_dir=cache_dir)
        s = Session(model=model, input_ids=input_ids, dense=dense, windows=dict(windows), **shared)
        s.hidden = layer_inputs(model, input_ids)
        sessions[text] = s
    return Mix(sessions=sessions, kinds={t: kinds[t] for t in ids})


def mix_key(mix: Mix) -> str:
    """The progress file's key: the one text's (:func:`progress_key`), or the texts' keys together."""
    if len(mix.sessions) == 1:
        return progress_key(mix.first)
    keys = [[text, progress_key(s)] for text, s in mix.sessions.items()]
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:24]


def choice_costs(mix: Mix, choices: Sequence[Choice], progress: Progress, say) -> Dict[int, Dict[Choice, float]]:
    """Each (layer, choice)'s cost (:func:`sparseflow.calibrate.costs.choice_costs`): its mean over the texts."""
    per = [_costs.choice_costs(s, choices, mix.store(progress, t), say) for t, s in mix.sessions.items()]
    return {layer: {c: _mean(p[layer][c] for p in per) for c in opts} for layer, opts in per[0].items()}


def measure_entry(
    mix: Mix, layer: int, choice: Choice, progress: Progress, say: Callable[[str], None], label: str, cost=None
) -> Measurement:
    """One single-layer choice measured on every text (each kept in the progress file at once,
    with the text's own cost), combined by :func:`combine_measurements`."""
    key, single = f"{layer}:{choice.key}", len(mix.sessions) == 1
    per = []
    for text, s in mix.sessions.items():
        store = mix.store(progress, text)
        got = store.layers.get(key)
        if got is None:
            tag = label if single else f"{label} {text}"
            per.append(_measure.measure_entry(s, layer, choice, store, say, tag, store.costs.get(key, cost)))
        else:  # a mix interrupted part-way: this text has it already
            per.append(Measurement(**got))
    m = combine_measurements(per)
    if not single:
        progress.layers[key] = m.to_dict()
        progress.save()
    return m


def screens(mix: Mix) -> bool:
    """Whether single-layer choices are screened on the first text before the others: with
    several texts, one text's KL is a lower bound of the mix's (its largest), which settles some
    choices without measuring them on the other texts (:func:`sparseflow.calibrate.greedy.unsettled`)."""
    return len(mix.sessions) > 1


def screen_entry(
    mix: Mix, layer: int, choice: Choice, progress: Progress, say: Callable[[str], None], label: str, cost=None
) -> float:
    """The choice measured on the first text only (kept in that text's section): its KL, a lower
    bound of the mix's."""
    text, s = next(iter(mix.sessions.items()))
    store, key = mix.store(progress, text), f"{layer}:{choice.key}"
    got = store.layers.get(key)
    if got is not None:
        return float(got["kl"])
    return _measure.measure_entry(s, layer, choice, store, say, f"{label} {text}", store.costs.get(key, cost)).kl


def kl_bound(mix: Mix, layer: int, choice: Choice, progress: Progress) -> float:
    """The largest KL the texts measured so far give the choice (0 when none has): a lower bound
    of its mix KL."""
    key = f"{layer}:{choice.key}"
    kls = [got["kl"] for t in mix.sessions if (got := mix.store(progress, t).layers.get(key)) is not None]
    return max(kls, default=0.0)


def combine_measurements(per_text: Iterable[Measurement]) -> Measurement:
    """One choice over the texts: the largest KL, the lowest top-1, the mean density and cost."""
    ms = list(per_text)
    return Measurement(
        kl=max(m.kl for m in ms),
        top1=min(m.top1 for m in ms),
        density=_mean(m.density for m in ms),
        cost=_mean(m.cost for m in ms),
    )


def measure_mix_plan(mix: Mix, chosen: Sequence[Choice]) -> Dict:
    """A whole plan's fidelity on every text, combined by :func:`combine_fidelity`."""
    per = {t: _measure.measure_plan(s, plan_of_choices(s, chosen)) for t, s in mix.sessions.items()}
    return combine_fidelity(per, mix.kinds)


def combine_fidelity(per_text: Mapping[str, Dict], kinds: Mapping[str, str]) -> Dict:
    """One plan over the texts: the worst text's mean KL, the largest p99 KL, the lowest top-1, the
    mean density (per layer too); each text's own numbers under ``texts``, each kind's worst KL
    under ``kinds``. One text: its own dict, with those added."""
    fids = list(per_text.values())
    worst = max(per_text, key=lambda t: per_text[t]["mean_kl"])
    if len(fids) == 1:
        out = dict(fids[0])
    else:
        out = {
            "mean_kl": per_text[worst]["mean_kl"],
            "p99_kl": max(f["p99_kl"] for f in fids),
            "top1": min(f["top1"] for f in fids),
            "density": _mean(f["density"] for f in fids),
            "density_per_layer": [
                None if None in col else _mean(col) for col in zip(*(f["density_per_layer"] for f in fids))
            ],
            "tokens": per_text[worst]["tokens"],
            "positions": per_text[worst]["positions"],
        }
    out["worst_text"] = worst
    out["texts"] = {t: {"kind": kinds[t], **{k: f[k] for k in PER_TEXT if k in f}} for t, f in per_text.items()}
    out["kinds"] = {
        kind: max(f["mean_kl"] for t, f in per_text.items() if kinds[t] == kind)
        for kind in sorted({kinds[t] for t in per_text})
    }
    return out


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals)
