"""Package layout: each method's code sits in its own folder and uses no other method's folder
(code shared by methods goes through sparseflow/kernels/), and no module imports itself back
through others (shared code sits below what uses it)."""

from __future__ import annotations

import ast
import pathlib
import re

import sparseflow
from sparseflow import methods

PACKAGE = pathlib.Path(sparseflow.__file__).resolve().parent
METHOD_NAMES = ("bsa", "dense", "pbs", "pisa")


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` reads from; ``package``: the importing file's
    package, for a relative import."""
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    return base


def _imported_modules(source: str, package: str) -> set:
    """Absolute names of the modules (and ``from`` targets) one source file imports, or names as
    "module:function" strings. ``package``: the file's package, for its relative imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("sparseflow."):
            found.add(node.value.split(":")[0])
    return found


def _foreign_methods(modules: set, own: str) -> set:
    prefixes = {f"sparseflow.methods.{m}" for m in METHOD_NAMES if m != own}
    return {mod for mod in modules if any(mod == p or mod.startswith(p + ".") for p in prefixes)}


def test_the_import_scan_sees_relative_absolute_and_string_imports():
    src = (
        "from ..pisa import reference\nfrom .. import bsa\nimport sparseflow.methods.dense.reference\n"
        "X = 'sparseflow.methods.pisa.flex:pisa_attention'\nfrom ...kernels import token_blocks\n"
        "from . import triton_impl\n"
    )
    found = _foreign_methods(_imported_modules(src, "sparseflow.methods.pbs"), "pbs")
    assert found == {
        "sparseflow.methods.pisa",
        "sparseflow.methods.pisa.reference",
        "sparseflow.methods.bsa",
        "sparseflow.methods.dense.reference",
        "sparseflow.methods.pisa.flex",
    }


def test_methods_do_not_import_each_other():
    offenders = {}
    for name in METHOD_NAMES:
        for path in sorted((PACKAGE / "methods" / name).glob("*.py")):
            modules = _imported_modules(path.read_text(), f"sparseflow.methods.{name}")
            foreign = _foreign_methods(modules, name)
            if foreign:
                offenders[str(path.relative_to(PACKAGE))] = sorted(foreign)
    assert not offenders, f"method folders importing another method's folder: {offenders}"


def test_every_method_folder_is_scanned():
    assert set(METHOD_NAMES) == set(methods.names())
    for name in METHOD_NAMES:
        assert (PACKAGE / "methods" / name / "__init__.py").is_file()


def test_backends_and_onnx_bodies_live_in_their_method_folder():
    for spec in methods.specs():
        home = f"sparseflow.methods.{spec.name}."
        targets = [backend.target for backend in spec.backends.values()] + [spec.onnx.mask]
        if spec.decode is not None:
            targets.append(spec.decode.step)
        for target in targets:
            assert target.startswith(home), f"{spec.name}: {target} is outside {home[:-1]}"


def test_kernels_holds_only_shared_code():
    leftovers = [p.name for p in (PACKAGE / "kernels").iterdir() if p.is_dir() and p.name in METHOD_NAMES]
    assert not leftovers, f"per-method folders under sparseflow/kernels/: {leftovers}"


EVAL_MODULES = ("attention_mass", "diagnostics", "evaluate", "fidelity", "niah", "plots", "sweep")
# the rewrite and attention path: none of it may need the research code
CORE = (
    "__init__.py",
    "api.py",
    "option_checks.py",
    "recipe_options.py",
    "dynamo_backend.py",
    "model_marks.py",
    "rewrite_report.py",
    "ops.py",
    "op_*.py",
    "autobackend.py",
    "hf.py",
    "config.py",
    "selection.py",
    "tuning.py",
    "recording.py",
    "decode_state.py",
    "onnx_export.py",
    "context_parallel.py",
    "passes/*.py",
    "methods/*.py",
    "methods/*/*.py",
    "kernels/*.py",
)


def _package_of(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def test_research_code_is_in_eval_and_off_the_core_path():
    assert not [m for m in EVAL_MODULES if (PACKAGE / f"{m}.py").exists()]
    assert all((PACKAGE / "eval" / f"{m}.py").is_file() for m in EVAL_MODULES)
    offenders = {}
    for pattern in CORE:
        for path in sorted(PACKAGE.glob(pattern)):
            modules = _imported_modules(path.read_text(), _package_of(path))
            hits = sorted(m for m in modules if m == "sparseflow.eval" or m.startswith("sparseflow.eval."))
            if hits:
                offenders[str(path.relative_to(PACKAGE))] = hits
    assert not offenders, f"core modules importing sparseflow.eval: {offenders}"


# the modules a call passes through below sparseflow.ops: the ops' entry and context parallelism
# build on them, so neither may be imported back (an import cycle)
OP_LAYERS = tuple(sorted(p.name for p in PACKAGE.glob("op_*.py"))) + ("autobackend.py", "graph_replay.py")


def test_the_ops_layers_import_neither_the_ops_nor_context_parallelism():
    above = ("sparseflow.ops", "sparseflow.context_parallel")
    offenders = {}
    for name in OP_LAYERS + ("context_parallel.py",):
        modules = _imported_modules((PACKAGE / name).read_text(), "sparseflow")
        hits = sorted(m for m in modules if any(m == a or m.startswith(a + ".") for a in above))
        if hits:
            offenders[name] = hits
    assert len(OP_LAYERS) > 2 and not offenders, f"imports of the layers above: {offenders}"


# The registry is the only door into a method: outside sparseflow/methods/, a module reaches a
# method through its MethodSpec (names of "module:function" targets included), never by importing
# the method's package. Allowed, each with why:
METHOD_IMPORTS_ALLOWED = {
    "config.py": "re-exports the built-in config classes under their public names",
}


def test_nothing_outside_the_methods_imports_a_method():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith("methods/") or name.startswith(tuple(METHOD_IMPORTS_ALLOWED)):
            continue
        hits = _foreign_methods(_imported_modules(path.read_text(), _package_of(path)), "")
        if hits:
            offenders[name] = sorted(hits)
    assert not offenders, f"modules importing a method's package instead of going through the registry: {offenders}"
    # and the scan does see such an import
    assert _foreign_methods(_imported_modules("from .methods.pbs import permutation", "sparseflow"), "")


TESTS = pathlib.Path(__file__).resolve().parent


def test_test_folders_mirror_the_package():
    folders = [p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__" and "__pycache__" not in p.parts]
    strays = [str(p.relative_to(TESTS)) for p in folders if not (PACKAGE / p.relative_to(TESTS)).is_dir()]
    assert folders and not strays, f"test folders with no package folder of that name: {strays}"


def _one_method_of(test_file: pathlib.Path) -> str:
    """The method a test file is about, from its name (``test_pbs_triton.py``: ``"pbs"``), or ""
    for a file about several (``test_pisa_bsa_triton.py``, which belongs in tests/methods/)."""
    words = test_file.stem.split("_")[1:]
    # "dense" also names the SDPA fallback of every method (test_dense_memo.py is about ops)
    named = [w for w in words[:2] if w in METHOD_NAMES and w != "dense"]
    return named[0] if len(named) == 1 and words[0] == named[0] else ""


def test_method_tests_sit_in_their_method_folder():
    misplaced = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if _one_method_of(p) and p.parent != TESTS / "methods" / _one_method_of(p)
    ]
    assert not misplaced, f"method tests outside tests/methods/<method>/: {misplaced}"


def test_each_method_config_lives_in_its_folder():
    from sparseflow import config
    from sparseflow.methods import specs

    for spec in specs():
        assert spec.config_type.__module__ == f"sparseflow.methods.{spec.name}.config", spec.name
        assert config.METHODS[spec.name] is spec.config_type


# The core lists methods from the registry (sparseflow.methods.names / sparse_names), so that a
# method registered there reaches every default; a literal list of method names in a core module
# is one more place to edit for each new method. methods/ holds the methods themselves; tuning.py
# names each method's options until they move into the methods' registry entries.
METHOD_LISTS_ALLOWED = ("methods/", "tuning.py")


def _method_name_lists(source: str, method_names) -> list:
    """``(line, names)`` of each tuple, list or set literal in ``source`` holding two or more
    string literals that name methods, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = [
                e.value
                for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in method_names
            ]
            if len(named) >= 2:
                found.append((node.lineno, named))
    return sorted(found)


def test_the_method_list_scan_sees_literal_lists():
    source = (
        'A = ("pbs", "pisa")\n'
        'def f(methods=["dense", "pbs"]):\n    return methods\n'
        'ok = m in {"pisa", "pbs", "other"}\n'
        'B = ("dense", None)\n'  # one name: a (name, value) pair, not a list of methods
        'C = ("pbs_lse", "flat_lse")\n'  # names that only start like a method's
        "D = sparse_names()\n"
    )
    found = _method_name_lists(source, ("dense", "pbs", "pisa"))
    assert found == [(1, ["pbs", "pisa"]), (2, ["dense", "pbs"]), (4, ["pisa", "pbs"])]


def test_the_core_spells_no_method_lists():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        found = [] if name.startswith(METHOD_LISTS_ALLOWED) else _method_name_lists(path.read_text(), methods.names())
        if found:
            offenders[name] = found
    assert not offenders, (
        "core modules listing methods by name; read them from the registry "
        f"(sparseflow.methods.names / sparse_names): {offenders}"
    )


# A module longer than this holds several jobs: split it where its jobs part (issue 50).
MAX_MODULE_LINES = 700
# Files allowed past it, as paths under sparseflow/, each with why; the test fails when one of
# them is back under the bound, so that its entry goes too. Triton kernel files: a module is one
# kernel family, its @triton.jit bodies (sharing their inlined @triton.jit helpers) beside the
# triton_op launchers that set their grids, tiles and arguments; split apart, one kernel's
# contract would be spread over several files.
LONG_MODULES_ALLOWED = {
    # token-sparse attention (PISA and BSA selections): the forward and the two backward kernels
    # share the visibility, window and whole-block helpers and the online softmax
    "kernels/token_sparse_triton.py",
    # PBS's block-sparse forward: one kernel, its autotune configs and pruning, the TMA and
    # heads-first launch choices, and the block-list layout the kernel reads
    "methods/pbs/triton_attention.py",
    # PBS's strided estimates: the estimate kernel with its step/loop helpers, the split-LSE
    # combine, and _strided_prob_row, which triton_select's selection kernel also inlines
    "methods/pbs/triton_estimate.py",
    # PBS stages 1-3: key scores (proxy passes, LSE combine), the segment sort and the block
    # selection kernel, each beside its launcher
    "methods/pbs/triton_select.py",
    # PISA's scan walk: four kernels handing each other one score table / pair index layout
    "methods/pisa/triton_select_scan.py",
    # PISA's tiled walk: one kernel with its union-scoring helpers, its op and the op's body
    # (tiled_walk, which triton_trace also calls with the kernel's debug trace output)
    "methods/pisa/triton_select_tiled.py",
}


def _line_count(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_past_the_line_bound():
    lengths = {p.relative_to(PACKAGE).as_posix(): _line_count(p) for p in sorted(PACKAGE.rglob("*.py"))}
    too_long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES and name not in LONG_MODULES_ALLOWED}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines, split them by job: {too_long}"
    short = sorted(name for name in LONG_MODULES_ALLOWED if lengths.get(name, 0) <= MAX_MODULE_LINES)
    assert not short, (
        f"LONG_MODULES_ALLOWED lists modules within {MAX_MODULE_LINES} lines (or gone), remove them: {short}"
    )


_COMPLEXITY_NOQA = re.compile(r"#\s*noqa:.*\b(C901|PLR0912|PLR0915)\b")


def _complexity_exemptions_outside_kernels(source: str) -> list:
    """Lines of ``source`` that silence a complexity rule anywhere but on a @triton.jit def."""
    lines = source.splitlines()
    return [
        i + 1
        for i, line in enumerate(lines)
        if _COMPLEXITY_NOQA.search(line)
        and not (line.lstrip().startswith("def ") and lines[i - 1].strip() == "@triton.jit")
    ]


def test_the_exemption_scan_sees_a_silenced_host_function():
    kernel = "@triton.jit\ndef _k(  # noqa: C901, PLR0915\n    x,\n):\n    pass\n"
    host = "def run(x):  # noqa: PLR0912\n    pass\n"
    assert _complexity_exemptions_outside_kernels(kernel) == []
    assert _complexity_exemptions_outside_kernels(host) == [1]


def test_only_triton_kernels_are_exempt_from_the_complexity_bounds():
    """pyproject's ruff bounds (C901 at 12, PLR0912, PLR0915) hold in the package; a @triton.jit
    kernel may be exempt on its def line (constexpr branches are compile-time specialisations),
    nothing else."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        bad = _complexity_exemptions_outside_kernels(path.read_text())
        if bad:
            found[path.relative_to(PACKAGE).as_posix()] = bad
    assert not found, f"complexity rules silenced outside a @triton.jit def (split the function instead): {found}"


# Import cycles known and being removed elsewhere, each the set of modules of one cycle; the test
# fails when one of them is gone, so that its entry goes too.
KNOWN_IMPORT_CYCLES: set = set()  # none left: a cycle that must stay is named here, with why


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``<root>/methods/pbs/triton_impl.py`` -> ``<root name>.methods.pbs.triton_impl``; a
    package's ``__init__.py`` is the package itself."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: pathlib.Path) -> dict:
    """Every module of the package at ``root`` -> the package's modules it imports, by any
    ``import`` or ``from ... import`` in its source (at module level or inside a function: either
    runs the imported module's code). ``from pkg import name`` imports the module ``pkg.name``
    when there is one, else ``pkg``'s ``__init__``. A submodule's parent package is not counted:
    Python imports it first, before the submodule can import anything. Imports under
    ``if TYPE_CHECKING:`` never run and are not counted."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, package)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (type checkers' imports only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if (
                isinstance(test, (ast.Name, ast.Attribute))
                and (getattr(test, "id", None) or test.attr) == "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _import_cycles(graph: dict) -> list:
    """One cycle per strongly connected group of modules (each reaching every other through
    imports), as the modules along it, the first again at the end (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = set()
            while module not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                cycles.append(_cycle_through(graph, group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def _cycle_through(graph: dict, group: set) -> list:
    """A shortest import path from the group's first module back to itself, within the group
    (breadth first: the paths found by round ``r`` are at most ``r`` imports long)."""
    start = min(group)
    paths = {start: [start]}
    while True:
        for path in list(paths.values()):
            for target in sorted(graph[path[-1]] & group):
                if target == start:
                    return path + [start]
                paths.setdefault(target, path + [target])


def test_the_cycle_scan_sees_function_level_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from . import a\n",
        "a.py": "def f():\n    from .sub import helper\n",  # the package sub's __init__ names it
        "sub/__init__.py": "from .b import helper\n",
        "sub/b.py": "import pkg.c\n",
        "c.py": "from . import a\n",
        "d.py": "from .a import f\n",  # imports a, which nothing leads back from to d
    }
    for name, source in files.items():
        (pkg / name).write_text(source)
    graph = _import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub"} and graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.d"] == {"pkg.a"}
    assert _import_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_package_has_no_import_cycles():
    cycles = _import_cycles(_import_graph(PACKAGE))
    found = {frozenset(cycle) for cycle in cycles}
    new = [" -> ".join(cycle) for cycle in cycles if frozenset(cycle) not in KNOWN_IMPORT_CYCLES]
    assert not new, f"import cycles in sparseflow/: {new}"
    gone = [sorted(cycle) for cycle in KNOWN_IMPORT_CYCLES - found]
    assert not gone, f"KNOWN_IMPORT_CYCLES lists cycles that no longer exist, remove them: {gone}"


# A result file cited in the package source: under benchmarks/results/, or named like one
# (pbs_h200.json, pbs_h200_total_2026-11-29.log, pisa_node_scan_h200). The source states each
# choice and its reason; docs/results.md names the measurement behind it and its file.
RESULT_CITATION = re.compile(r"benchmarks/results|_h[12]00(?:[\w.-]*\.(?:json|log)\b|\b)")
# Files that may still cite result files while they are reworked elsewhere, as paths under
# sparseflow/ ("ops.py"); the test fails when one of them cites none any more, so that its entry
# goes too. ops.py, calibrate.py and context_parallel.py, being restructured, cite none, so none
# is listed.
RESULT_CITATIONS_ALLOWED = frozenset()


def _result_citations(source: str) -> list:
    """``(line number, line)`` of each line of ``source`` that cites a result file."""
    return [(n, line.strip()) for n, line in enumerate(source.splitlines(), 1) if RESULT_CITATION.search(line)]


def test_the_citation_scan_sees_result_file_names():
    cited = (
        "See benchmarks/results/smollm2_*_8k.json.",
        "0.849x for 128x64 (pbs_variants_d64_h200.log)",
        "8.6x faster at 8K: pbs_h200_total_2026-11-29.log",
        "(pisa_h200_k8_warps1.json vs pisa_h200.json)",
        "# layers at 8K (pisa_layer_launch_sweep_packed_h200) 64 rows beat 48",
        "`e2e_prefill_h200.{json,log,png}`",
        "estimate_h100.log",
    )
    clean = (
        'MEASURED["pbs_h200_end_to_end"]',
        "on an H200, 64-row tiles take a third less time",
        "benchmarks/pbs.py --part check",
        "out = mx_s + tl.log(s)",
        "a recipe .json file",
    )
    assert [s for s in cited if not RESULT_CITATION.search(s)] == []
    assert [s for s in clean if RESULT_CITATION.search(s)] == []
    assert _result_citations("a\n# see bsa_merge_h200.log\nb\n") == [(2, "# see bsa_merge_h200.log")]


def test_the_package_cites_no_result_files():
    citing, cites = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        found = _result_citations(path.read_text())
        if found:
            citing.add(name)
        if name not in RESULT_CITATIONS_ALLOWED:
            cites += [f"sparseflow/{name}:{n}: {line}" for n, line in found]
    assert not cites, (
        "result files cited in the package source; state the choice and its reason there, and name the "
        "measurement and its file in docs/results.md:\n" + "\n".join(cites)
    )
    clean = sorted(RESULT_CITATIONS_ALLOWED - citing)
    assert not clean, f"RESULT_CITATIONS_ALLOWED lists files that cite no result file any more, remove them: {clean}"
