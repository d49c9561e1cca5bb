"""``sparseflow calibrate``: measure a per-layer plan for a checkpoint within a KL budget.

On real text, for each layer and each choice the method offers (PBS: threshold, permutation,
scoring; PISA/BSA: ``top_k``; and dense), the model runs with only that layer sparse and the mean
KL of its next-token distributions against the dense model is recorded, with the layer's measured
selection density. Single-layer runs are cheap: one dense pass stores the hidden state entering
every layer, and a run for layer ``L`` starts there (layers before ``L`` are skipped).

A greedy search then walks from the cheapest choice per layer towards dense, each step taking
the upgrade with the largest KL reduction per unit of predicted cost, until the sum of the
single-layer KLs fits the allowed sum; the whole-model KL of that plan is measured. The sum
predicts it only roughly, either way: layers interact, and in bf16 each sparse layer's KL
carries a rounding floor that does not add up across layers (a 32K plan on SmolLM2 predicted
0.0053 and measured 0.0022). So while the plan exceeds the calibration target the allowed sum
shrinks by the measured / predicted ratio, while it stays under :data:`GROW_BELOW` of the target
the sum grows by the headroom, and once plans on both sides are known it is bisected; the
cheapest measured plan within the target is kept (all layers dense at worst). The budget is
meant for the text the model will serve, not only the calibration text, so the target is
``margin`` x budget (default :data:`DEFAULT_MARGIN`) and the rest is headroom for text the plan
was not calibrated on; the first allowed sum is ``safety`` x that target. Every plan on the walk costs more than the one before and the walk does not depend
on the budget, so a larger allowed sum stops earlier on it; the correcting rounds make that
monotonicity in the budget a property of the measurements (tested), not a guarantee.

Not every (layer, choice) needs its KL for that walk. Every choice's cost is known before its KL
(its selection's density on the layer's q/k/v, without the attention or the rest of the model;
or its time), and a KL is never below 0, so a choice can only change the walk where it could be
a layer's cheapest option or where, even at KL 0, its KL reduction per added cost would match the
upgrade the walk takes. Only such choices are measured, the walk is rerun, until none is left
(:func:`unsettled`): the plan is the one the whole grid gives, and the skipped choices are listed
with their reason in the recipe's ``measured["single_layer"]`` (``prune=False`` /
``--measure-all`` measures the whole grid). A choice costing at least dense's 1 is always skipped:
dense is as cheap with KL 0.

Cost is in units of one dense attention call of the layer: on CPU (``cost="density"``) the
measured density plus the estimate's overhead (each method's ``estimate_cost``); with
``cost="time"`` (the default where CUDA is present) the op's measured time on the layer's own
q/k/v divided by dense SDPA's.

Several texts at once (the default ``--text pydoc_topics,stdlib_source,copy_clauses``: prose,
code and copy-heavy text, :data:`sparseflow.texts.TEXTS`) are a mix (:mod:`.mix`): every choice's cost,
single-layer KL and every whole plan is measured on each text, and the plan's KL constraint holds
on the worst text (a choice's KL in the walk is its largest over the texts, a plan's measured KL
its largest; costs and densities are means). A choice the pruned walk needs is measured on the
first text before the others: that KL bounds the mix's from below, and a choice the bound already
settles is not measured on the rest (on SmolLM2 at 128K tokens, 29% fewer single-text
measurements; put the text with the largest KLs first). ``--heldout-text`` takes a list too (default one text
of each kind: stdlib_docs, more_stdlib_source, copy_log); the recipe's
``measured`` gives each text's KL, top-1 and density with its kind, and each kind's worst KL.

The result is a :class:`sparseflow.recipes.Recipe` (base config in ``configs``, per-layer
changes in ``layer_overrides``, ``dense_layers``) with both fidelities in ``measured``; every
``--recipe`` argument reads the file. Single-layer results are kept in a progress file, so a
rerun after an interruption measures only what is missing.

The modules, in the order a run uses them: :mod:`.choices` (the grid and its measurements),
:mod:`.session` (the model, tokens and dense reference; plans), :mod:`.inputs` (each layer's
hidden state and q/k/v), :mod:`.costs` (a choice's cost before its KL), :mod:`.measure`
(single-layer and whole-plan KL), :mod:`.mix` (both on every text of a mix, combined), :mod:`.texts`
(which texts, and their checks), :mod:`.progress` (the resume file), :mod:`.grid` (the table,
whole or measured on demand), :mod:`.greedy` (the walk), :mod:`.plan_search` (the correcting
rounds), :mod:`.recipe`, :mod:`.run` (:func:`calibrate`) and :mod:`.command` (:func:`calibrate_file`).
"""

from .choices import (
    DEFAULT_SCORINGS,
    DEFAULT_THRESHOLDS,
    DEFAULT_TOP_KS,
    DENSE,
    DENSE_MEASUREMENT,
    Choice,
    Measurement,
    Table,
    candidate_choices,
    estimate_overhead,
)
from .command import calibrate_file, calibration_tokens, load_model, parse_values, side_paths
from .costs import choice_cost, layer_costs, selection_densities, timed_cost
from .greedy import chosen_options, frontier, greedy_plan, unsettled
from .grid import LazyGrid, measure_all, single_layer_report, skip_reason
from .inputs import decoder_layers, each_layer_qkv, layer_inputs, layer_qkv, start_at
from .measure import DenseReference, dense_reference, measure_layer, measure_plan
from .mix import Mix, combine_fidelity, combine_measurements, measure_mix_plan, open_mix
from .plan_search import GROW_BELOW, search
from .progress import Progress, progress_key
from .recipe import build_recipe
from .run import DEFAULT_MARGIN, CalibrationResult, calibrate, check_budget
from .session import Session, plan_of_choices
from .texts import check_disjoint, named_texts, parse_texts, text_kinds, text_tokens

__all__ = [
    "Choice",
    "Measurement",
    "CalibrationResult",
    "candidate_choices",
    "calibrate",
    "calibrate_file",
    "greedy_plan",
    "DEFAULT_THRESHOLDS",
    "DEFAULT_TOP_KS",
    "DEFAULT_SCORINGS",
    "DEFAULT_MARGIN",
    # the steps, for studies and tests that run them one by one
    "DENSE",
    "DENSE_MEASUREMENT",
    "GROW_BELOW",
    "DenseReference",
    "LazyGrid",
    "Mix",
    "Progress",
    "Session",
    "Table",
    "build_recipe",
    "calibration_tokens",
    "check_budget",
    "check_disjoint",
    "combine_fidelity",
    "combine_measurements",
    "choice_cost",
    "chosen_options",
    "decoder_layers",
    "dense_reference",
    "each_layer_qkv",
    "estimate_overhead",
    "frontier",
    "layer_costs",
    "layer_inputs",
    "layer_qkv",
    "load_model",
    "measure_all",
    "measure_layer",
    "measure_mix_plan",
    "measure_plan",
    "named_texts",
    "open_mix",
    "parse_texts",
    "parse_values",
    "plan_of_choices",
    "progress_key",
    "search",
    "selection_densities",
    "side_paths",
    "single_layer_report",
    "skip_reason",
    "start_at",
    "timed_cost",
    "text_kinds",
    "text_tokens",
    "unsettled",
]
