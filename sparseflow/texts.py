"""The real texts the project measures against (:data:`TEXTS`), each shipped with the standard
library or built from it by a seeded generator: nothing is downloaded, and a text is the same on
every run of one Python version (the sources and docs change between versions, so results record
the version next to the text name). Each text has a *kind* (:data:`KINDS`): ``prose``, ``code``,
or ``copy`` (later passages repeat earlier ones verbatim, :mod:`sparseflow.copy_texts`), so a
command can report a plan's fidelity per kind of text."""

from __future__ import annotations

from typing import Callable, NamedTuple

from . import copy_texts

KINDS = ("prose", "code", "copy")


class Text(NamedTuple):
    load: Callable[[], str]
    description: str
    kind: str  # one of KINDS


def _pydoc_topics() -> str:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def _argparse_source() -> str:
    # A second real text of a different kind (code + docstrings, ~100 KB, ~25K SmolLM2 tokens):
    # the source of the running interpreter's argparse module.
    import argparse
    import inspect

    return inspect.getsource(argparse)


# argparse is left out: it is the other code text, so this one can hold out for it too
_STDLIB_MODULES = ("typing", "inspect", "dataclasses", "functools", "enum", "subprocess", "tarfile", "threading")


def _stdlib_source() -> str:
    # A long code text (~0.67 MB, ~170K SmolLM2 tokens) for checks at 32K-128K, where
    # argparse_source (~22K tokens) is too short.
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in _STDLIB_MODULES)


# A second long code text, held out for the first at 32K-128K (argparse_source is too short there):
# pure-Python twins of C modules and tools, none of them in _STDLIB_MODULES or _DOC_MODULES
_HELDOUT_CODE_MODULES = (
    "_pydecimal", "_pyio", "pickletools", "email._header_value_parser", "logging.handlers", "pdb",
    "asyncio.base_events", "multiprocessing.managers",
)  # fmt: skip


def _more_stdlib_source() -> str:
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in _HELDOUT_CODE_MODULES)


# Modules whose docstrings make the second prose text: none is a source of the code texts, so
# a plan calibrated on code can be checked on this prose and the other way round.
_DOC_MODULES = (
    "collections", "os", "pathlib", "json", "re", "random", "statistics", "shutil", "string", "textwrap",
    "logging", "unittest", "email.message", "decimal", "fractions", "heapq", "contextlib", "copy", "pickle",
    "csv", "configparser", "difflib", "zipfile", "urllib.parse", "http.client", "socket", "selectors",
    "asyncio", "queue", "calendar", "locale", "gettext", "codecs", "tempfile", "pprint", "traceback",
    "warnings", "ast", "tokenize", "base64", "uuid", "ipaddress", "xml.etree.ElementTree", "html.parser",
    "mimetypes", "smtplib", "imaplib", "ftplib", "optparse", "cmd", "shlex", "doctest", "timeit", "pstats",
    "trace", "bisect", "gzip", "lzma", "numbers", "sched", "mailbox", "plistlib", "wave", "netrc",
    "unittest.mock", "pydoc", "http.server", "http.cookies", "urllib.request", "xml.dom.minidom",
    "concurrent.futures", "email.utils", "email.parser", "importlib.metadata", "zoneinfo", "ssl", "poplib",
    "graphlib", "glob", "fnmatch", "filecmp", "fileinput", "quopri", "zipapp", "runpy", "pkgutil", "reprlib",
)  # fmt: skip


def _stdlib_docs() -> str:
    import importlib

    seen, out = set(), []
    for name in _DOC_MODULES:
        for title, doc in _module_docs(importlib.import_module(name)):
            if doc not in seen:  # generated docstrings ("An enumeration.") would be verbatim repeats
                seen.add(doc)
                out.append(f"{title}\n\n{doc}")
    return "\n\n".join(out)


def _module_docs(module) -> list:
    """``(name, docstring)`` of the module and of its own classes, functions and methods (not the
    inherited ones, which would repeat)."""
    import inspect

    def own(name, obj):
        doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
        return [(name, inspect.cleandoc(doc))] if doc and doc.strip() else []

    out = own(module.__name__, module)
    for key, obj in sorted(vars(module).items()):
        if key.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            out += own(f"{module.__name__}.{key}", obj)
        if inspect.isclass(obj):
            for meth, fn in sorted(vars(obj).items()):
                if not meth.startswith("_") and inspect.isfunction(fn):
                    out += own(f"{module.__name__}.{key}.{meth}", fn)
    return out


# name -> Text(loader, description, kind)
TEXTS = {
    "pydoc_topics": Text(
        _pydoc_topics, "pydoc_data.topics: ~0.46 MB of English prose (Python reference manual topics)", "prose"
    ),
    "stdlib_docs": Text(
        _stdlib_docs,
        f"docstrings of {len(_DOC_MODULES)} standard-library modules (collections ... reprlib) and of their classes and "
        "functions, each once: ~0.5 MB of English prose about code, none from a code text's modules",
        "prose",
    ),
    "argparse_source": Text(
        _argparse_source, "Lib/argparse.py source of the running Python (code and docstrings)", "code"
    ),
    "stdlib_source": Text(
        _stdlib_source,
        "sources of " + ", ".join(_STDLIB_MODULES) + " of the running Python (~0.67 MB of code and docstrings)",
        "code",
    ),
    "more_stdlib_source": Text(
        _more_stdlib_source,
        "sources of " + ", ".join(_HELDOUT_CODE_MODULES) + " of the running Python (~0.77 MB of code and docstrings, "
        "no module of stdlib_source or stdlib_docs)",
        "code",
    ),
    "copy_clauses": Text(
        lambda: copy_texts.clauses(copy_texts.passages(_pydoc_topics())[::-1]),
        "numbered sections of pydoc_topics passages, last topic first; about half the sections repeat an earlier "
        "section verbatim (boilerplate clauses, retrieved passages; ~0.64 MB)",
        "copy",
    ),
    "copy_log": Text(
        copy_texts.log,
        "a made-up web service's log (seeded): request lines with varying fields, retries repeating recent lines, "
        "recurring tracebacks and configuration blocks, verbatim (~0.64 MB)",
        "copy",
    ),
}


# the texts of more than 128K SmolLM2 tokens (tests/test_texts.py checks), for long-context runs
LONG_TEXTS = ("stdlib_source", "more_stdlib_source", "stdlib_docs", "copy_clauses", "copy_log")


def real_text(name: str = "pydoc_topics") -> str:
    """A real text from :data:`TEXTS`, in a fixed order."""
    return TEXTS[check_text(name, "text")].load()


def text_kind(name: str) -> str:
    """The kind (:data:`KINDS`) of the shipped text ``name``."""
    return TEXTS[check_text(name, "text")].kind


def check_text(name, arg: str) -> str:
    """``name`` when it names a shipped text; ValueError naming ``arg`` otherwise."""
    if not isinstance(name, str) or name not in TEXTS:
        raise ValueError(f"{arg} must be one of {sorted(TEXTS)}, got {name!r}")
    return name
