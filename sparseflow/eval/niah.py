"""Needle retrieval (RULER-style passkeys) dense vs sparse: ``sparseflow eval MODEL --task niah``.

A prompt is real filler text (:func:`sparseflow.checkpoints.real_text`, split into sentences) with
passkey sentences inserted at sentence boundaries near the requested relative depths, ending with a
question; it is exactly ``n_tokens`` tokens long. ``prompt="chat"`` wraps it in the tokenizer's chat
template (the text as the user's turn, the answer's first words as the assistant's), which is how an
instruct model is meant to be asked; ``"plain"`` is a bare completion prompt; ``"auto"`` picks chat
when the tokenizer has a template. With ``keys=1`` one anonymous pass key sits at
the depth; with ``keys > 1`` each key has a name, the asked one sits at the depth and the others
(distractors) at seeded other depths. The answer is greedy decoding of a few tokens with the KV
cache: the prompt's prefill runs through the plan's attention (the sparse op answers the first
token and writes the cache the later tokens read). A sample is correct when the generated text
contains the asked key.
"""

from __future__ import annotations

import collections
import functools
import inspect
import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "NiahSample",
    "build_sample",
    "generate_greedy",
    "run_niah",
    "format_niah",
    "parse_depths",
    "is_correct",
    "prompt_format",
    "needle_recall",
]

PROMPT_FORMATS = ("auto", "chat", "plain")

_NAMES = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class NiahSample:
    ids: torch.Tensor  # [1, n_tokens]
    answer: str  # the asked key
    depth: float
    keys: Dict[str, str]  # name ("" for the single anonymous key) -> key
    asked: str  # the name of the asked key
    needle_starts: Dict[str, int] = field(default_factory=dict)  # name -> token index of its passkey sentence
    needle_lengths: Dict[str, int] = field(default_factory=dict)  # name -> tokens of its passkey sentence
    filler_span: Tuple[int, int] = (0, 0)  # token range [start, end) holding filler and needles


def parse_depths(text: str) -> List[float]:
    """``"0.1,0.5,0.9"`` -> [0.1, 0.5, 0.9]; each in [0, 1]."""
    try:
        depths = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or any(not (0.0 <= d <= 1.0) for d in depths):
        raise ValueError(f"--depths must be a comma list of numbers in [0, 1] (e.g. 0.1,0.5,0.9), got {text!r}")
    return depths


@functools.lru_cache(maxsize=4)
def _sentences(name: str) -> Tuple[str, ...]:
    from ..checkpoints import real_text

    flat = " ".join(real_text(name).split())
    return tuple(s for s in _SENTENCE_END.split(flat) if len(s) > 1)


def is_correct(generated: str, key: str) -> bool:
    """The key appears in the generated text (whitespace ignored: a tokenizer may space digits out)."""
    return key in "".join(generated.split())


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _prefix(tokenizer) -> List[int]:
    # the special tokens the tokenizer puts before a text by default (a BOS for most)
    return list(tokenizer("", add_special_tokens=True).input_ids)


def _needle(name: str, key: str) -> str:
    if name:
        return f" The pass key for {name} is {key}. Remember it. {key} is the pass key for {name}."
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def _question(name: str) -> str:
    if name:
        return f"\n\nWhat is the pass key for {name}? The pass key for {name} is"
    return "\n\nWhat is the pass key? The pass key is"


def _chat_question(name: str) -> Tuple[str, str]:
    """(the end of the user's turn, the start of the assistant's answer)."""
    whose = f" for {name}" if name else ""
    return f"\n\nWhat is the pass key{whose}? Answer with the number.", f"The pass key{whose} is"


_CONTENT_MARK = "@@sparseflow-niah-content@@"


def prompt_format(tokenizer, prompt: str) -> str:
    """``"chat"`` or ``"plain"``: ``prompt`` with ``"auto"`` resolved (chat when the tokenizer has a
    chat template); ``"chat"`` for a tokenizer without one is a ValueError."""
    if prompt not in PROMPT_FORMATS:
        raise ValueError(f"--prompt must be one of {', '.join(PROMPT_FORMATS)}, got {prompt!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt == "chat" and not has_template:
        raise ValueError("--prompt chat needs a tokenizer with a chat template; this one has none (use plain)")
    if prompt == "auto":
        return "chat" if has_template else "plain"
    return prompt


def _chat_frame(tokenizer) -> Tuple[List[int], List[int]]:
    """Token ids of the chat template before and after a user turn's content (the generation
    prompt included), so the prompt's length can be fixed exactly."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _CONTENT_MARK}], add_generation_prompt=True, tokenize=False
    )
    if rendered.count(_CONTENT_MARK) != 1:
        raise ValueError("--prompt chat: the tokenizer's chat template does not place the user's text once")
    before, after = rendered.split(_CONTENT_MARK)
    return _encode(tokenizer, before), _encode(tokenizer, after)


def _head_and_tail(tokenizer, asked: str, prompt: str) -> Tuple[List[int], List[int]]:
    """The tokens before the filler (specials, instructions) and after it (question, answer start)."""
    if prompt == "plain":
        return _prefix(tokenizer) + _encode(tokenizer, _INTRO), _encode(tokenizer, _question(asked))
    before, after = _chat_frame(tokenizer)
    question, answer_start = _chat_question(asked)
    return before + _encode(tokenizer, _INTRO), _encode(tokenizer, question) + after + _encode(tokenizer, answer_start)


_INTRO = (
    "A long text follows with one or more pass keys hidden inside it. Find them and keep them in mind: "
    "you will be asked for one.\n\n"
)


MAX_PIECE = 64  # tokens: a longer sentence (a table, a code listing) is cut into pieces this long


def _filler(tokenizer, sentences: List[str], start: int, budget: int) -> List[List[int]]:
    """Token lists of consecutive sentences from ``start`` (wrapping; each at most ``MAX_PIECE``
    tokens, so a needle lands within that many tokens of its depth) with exactly ``budget`` tokens."""
    out: List[List[int]] = []
    total, i = 0, start
    while total < budget:
        toks = _encode(tokenizer, " " + sentences[i % len(sentences)])
        for j in range(0, len(toks), MAX_PIECE):
            piece = toks[j : j + MAX_PIECE][: budget - total]
            if piece:
                out.append(piece)
                total += len(piece)
        i += 1
    return out


def _insert_at(chunks: List[List[int]], offsets: Dict[str, float], needles: Dict[str, List[int]]):
    """Interleave needles between filler sentences: each at the sentence boundary nearest its
    relative depth of the filler. Returns (tokens, name -> start index in the tokens)."""
    bounds = [0]
    for c in chunks:
        bounds.append(bounds[-1] + len(c))
    filler_len = bounds[-1]
    at: Dict[int, List[str]] = {}
    for name, depth in offsets.items():
        target = depth * filler_len
        k = min(range(len(bounds)), key=lambda j: (abs(bounds[j] - target), j))
        at.setdefault(k, []).append(name)
    tokens: List[int] = []
    starts: Dict[str, int] = {}
    for k in range(len(chunks) + 1):
        for name in at.get(k, []):
            starts[name] = len(tokens)
            tokens += needles[name]
        if k < len(chunks):
            tokens += chunks[k]
    return tokens, starts


def build_sample(
    tokenizer,
    n_tokens: int,
    depth: float,
    *,
    keys: int = 1,
    seed: int = 0,
    text: str = "pydoc_topics",
    prompt: str = "plain",
) -> NiahSample:
    """One prompt of exactly ``n_tokens`` tokens; deterministic in (n_tokens, depth, keys, seed, text,
    prompt). ``prompt``: ``"plain"``, ``"chat"`` or ``"auto"`` (:func:`prompt_format`)."""
    prompt = prompt_format(tokenizer, prompt)
    if keys < 1 or keys > len(_NAMES):
        raise ValueError(f"keys must be in [1, {len(_NAMES)}], got {keys}")
    if not (0.0 <= depth <= 1.0):
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"niah-{seed}-{keys}-{n_tokens}-{depth}")
    names = [""] if keys == 1 else rng.sample(_NAMES, keys)
    values = rng.sample(range(10000, 100000), keys)
    key_of = {name: str(v) for name, v in zip(names, values)}
    asked = names[0]
    needles = {name: _encode(tokenizer, _needle(name, key)) for name, key in key_of.items()}
    head, tail = _head_and_tail(tokenizer, asked, prompt)
    budget = n_tokens - len(head) - len(tail) - sum(len(t) for t in needles.values())
    if budget < 1:
        raise ValueError(
            f"--tokens {n_tokens} is too short for the passkey prompt: it needs more than {n_tokens - budget} tokens"
        )
    sentences = _sentences(text)
    chunks = _filler(tokenizer, sentences, rng.randrange(len(sentences)), budget)
    depths = {asked: depth}
    for name in names[1:]:  # distractors at other depths, away from the asked key
        depths[name] = rng.choice(
            [d for d in (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95) if abs(d - depth) > 0.08]
        )
    body, starts = _insert_at(chunks, depths, needles)
    ids = head + body + tail
    if len(ids) != n_tokens:  # the budget arithmetic above guarantees it
        raise RuntimeError(f"niah prompt has {len(ids)} tokens, expected {n_tokens}")
    return NiahSample(
        ids=torch.tensor([ids]),
        answer=key_of[asked],
        depth=depth,
        keys=key_of,
        asked=asked,
        needle_starts={n: len(head) + s for n, s in starts.items()},
        needle_lengths={n: len(t) for n, t in needles.items()},
        filler_span=(len(head), len(head) + len(body)),
    )


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def generate_greedy(model, ids: torch.Tensor, max_new_tokens: int = 8) -> List[int]:
    """Greedy decoding with the KV cache: one prefill of ``ids`` ([1, N], no attention mask, the
    path eval's plans run) then one token at a time."""
    kw = _cache_kw(model)
    out_ids: List[int] = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for step in range(max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out_ids.append(int(nxt))
            if step + 1 == max_new_tokens:
                break
            cache = getattr(out, "cache", None)
            cache = out.past_key_values if cache is None else cache
            out = model(input_ids=nxt, use_cache=True, **{kw: cache})
    return out_ids


def _density(calls) -> Tuple[Optional[float], int, int]:
    """(mean density of the prefill's sparse calls, sparse calls, dense calls)."""
    prefill = [c for c in calls if len(c.q_shape) > 2 and c.q_shape[2] > 1]
    sparse = [c for c in prefill if c.selection is not None]
    dens = [float(c.selection.density.float().mean()) for c in sparse]
    return (sum(dens) / len(dens) if dens else None), len(sparse), len(prefill) - len(sparse)


def needle_recall(calls, sample: NiahSample) -> Tuple[Optional[float], Optional[float]]:
    """How much of the asked needle the prompt's last position still attends in the sparse
    prefill: (mean over sparse layers, the lowest layer's), each layer's value the share of the
    needle's tokens its selection keeps for that query, averaged over heads. (None, None) when
    no layer ran sparse. A needle the last position cannot see is one the first answer token
    cannot copy."""
    start = sample.needle_starts[sample.asked]
    end = start + sample.needle_lengths[sample.asked]
    last = sample.ids.shape[1] - 1
    per_layer = []
    for call in calls:
        sel = call.selection
        if sel is None or len(call.q_shape) < 3 or call.q_shape[2] != sample.ids.shape[1]:
            continue
        keys = sel.row_keys(last, sel.density.shape[1])[..., start:end]
        per_layer.append(float(keys.float().mean()))
    if not per_layer:
        return None, None
    return sum(per_layer) / len(per_layer), min(per_layer)


def _run_one(model, tokenizer, sample: NiahSample, max_new_tokens: int, generate: Callable) -> Dict[str, object]:
    from ..recording import capture
    from .evaluate import model_device

    start = time.perf_counter()
    with capture(keep_selections=True) as cap:
        new = generate(model, sample.ids.to(model_device(model)), max_new_tokens)
    text = tokenizer.decode(new, skip_special_tokens=True)
    density, n_sparse, n_dense = _density(cap.calls)
    kept, kept_min = needle_recall(cap.calls, sample)
    return {
        "depth": sample.depth,
        "answer": sample.answer,
        "asked": sample.asked,
        "generated": text,
        "correct": is_correct(text, sample.answer),
        "density": density,
        "needle_kept": kept,
        "needle_kept_min_layer": kept_min,
        "sparse_calls": n_sparse,
        "dense_calls": n_dense,
        "seconds": time.perf_counter() - start,
    }


def _summary(name: str, plan, rows: List[Dict[str, object]], depths: Sequence[float]) -> Dict[str, object]:
    per_depth = {}
    for d in depths:
        hits = [r["correct"] for r in rows if r["depth"] == d]
        per_depth[str(d)] = sum(hits) / len(hits) if hits else None
    dens = [r["density"] for r in rows if r["density"] is not None]
    kept = [r["needle_kept"] for r in rows if r.get("needle_kept") is not None]
    return {
        "name": name,
        "method": plan.method if plan is not None else "dense",
        "config": plan.config.to_dict() if plan is not None else None,
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "accuracy_per_depth": per_depth,
        "density": sum(dens) / len(dens) if dens else 1.0,
        "needle_kept": sum(kept) / len(kept) if kept else None,
        "fallback_calls": sum(r["dense_calls"] for r in rows),
        "samples": rows,
    }


def run_niah(
    model,
    tokenizer,
    plans,
    *,
    n_tokens: int,
    depths: Sequence[float],
    samples: int = 4,
    keys: int = 1,
    text: str = "pydoc_topics",
    prompt: str = "plain",
    max_new_tokens: int = 8,
    generate: Callable = generate_greedy,
    on_result: Optional[Callable] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> List[Dict[str, object]]:
    """Accuracy of dense (SDPA) and of each :class:`sparseflow.hf.Plan` in ``plans`` on the same
    prompts (``samples`` per depth; ``prompt`` as for :func:`build_sample`). Returns one summary per
    run, dense first; the model is left on SDPA. ``progress`` gets one line per sample."""
    from ..hf import apply_plan

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    prompts = [
        build_sample(tokenizer, n_tokens, d, keys=keys, seed=s, text=text, prompt=prompt)
        for d in depths
        for s in range(samples)
    ]
    runs = [("dense", None)] + [(_plan_name(p, i, plans), p) for i, p in enumerate(plans)]
    out = []
    for name, plan in runs:
        if plan is None:
            model.set_attn_implementation("sdpa")
        else:
            apply_plan(model, plan)
        try:
            rows = []
            for i, sample in enumerate(prompts):
                rows.append(_run_one(model, tokenizer, sample, max_new_tokens, generate))
                if progress is not None:
                    r = rows[-1]
                    kept = "" if r["needle_kept"] is None else f", needle kept {r['needle_kept']:.2f}"
                    progress(
                        f"    {name} {i + 1}/{len(prompts)} depth {r['depth']:g}: {r['generated']!r} "
                        f"({'correct' if r['correct'] else 'wrong'}, key {r['answer']}{kept}, {r['seconds']:.0f} s)"
                    )
        finally:
            model.set_attn_implementation("sdpa")
        out.append(_summary(name, plan, rows, depths))
        if on_result is not None:
            on_result(out[-1])
    return out


def _plan_name(plan, index: int, plans) -> str:
    same_method_runs = collections.Counter(p.method for p in plans)[plan.method]
    return plan.method if same_method_runs == 1 else f"{plan.method}#{index}"


def format_niah(results: List[Dict[str, object]], depths: Sequence[float]) -> str:
    """A table: one row per run, accuracy per depth, overall accuracy, prefill density and the
    share of the needle the last prompt position attends (``-`` where every layer ran dense)."""
    w = max(8, *(len(r["name"]) for r in results))
    cols = [f"d={d:g}" for d in depths]
    head = f"{'method':<{w}} " + " ".join(f"{c:>7}" for c in cols) + f" {'all':>7} {'density':>8} {'needle':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        accs = [r["accuracy_per_depth"][str(d)] for d in depths]
        kept = "-" if r.get("needle_kept") is None else f"{r['needle_kept']:.2f}"
        lines.append(
            f"{r['name']:<{w}} "
            + " ".join(f"{a:>7.2f}" for a in accs)
            + f" {r['accuracy']:>7.2f} {r['density']:>8.3f} {kept:>7}"
        )
    return "\n".join(lines)
