"""Package layout: each method's code sits in its own folder and uses no other method's folder
(code shared by methods goes through sparseflow/kernels/)."""

from __future__ import annotations

import ast
import pathlib

import sparseflow
from sparseflow import methods

PACKAGE = pathlib.Path(sparseflow.__file__).resolve().parent
METHOD_NAMES = ("bsa", "dense", "pbs", "pisa")


def _imported_modules(source: str, package: str) -> set:
    """Absolute names of the modules (and ``from`` targets) one source file imports, or names as
    "module:function" strings. ``package``: the file's package, for its relative imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
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
