"""The public modules: what dir() shows, and the docstrings the API reference is generated from.

CPU only. For each public module (ptxattn, ptxattn.api, ptxattn.serving, ptxattn.fp8,
ptxattn.blockscaled, ptxattn.distributed, and ptxattn.torch, ptxattn.jax and
ptxattn.transformers where torch, JAX and transformers are installed): dir() is sorted(__all__),
every name of __all__ exists, and every public function has a numpy-style docstring
(mkdocstrings' numpy handler renders them): a one-line summary, a ``Parameters`` section naming
exactly the signature's parameters (none for a function that takes none), and an ``Examples``
section of ``>>>`` lines. A class has a summary, a ``Parameters`` or ``Attributes`` section and
``Examples``; a constant is named in its module's docstring. The examples need a GPU, so they
are not run.
"""

import importlib
import inspect
import re

import pytest

# module -> the framework it imports at import time, skipped where that is not installed
MODULES = {"ptxattn": None, "ptxattn.api": None, "ptxattn.serving": None, "ptxattn.fp8": None,
           "ptxattn.blockscaled": None, "ptxattn.distributed": None, "ptxattn.torch": "torch",
           "ptxattn.jax": "jax", "ptxattn.transformers": "transformers"}

# ptxattn's own __all__ also holds the runtime's exception classes and __version__; its reference
# page documents the entry points, so only those are held to the docstring rules.
ENTRY_POINTS = ("attention", "attention_backward", "attention_varlen",
                "attention_varlen_backward", "attention_with_kvcache", "merge_attention_states",
                "fp8_attention", "blockscaled_attention")

def _module(name: str):
    framework = MODULES[name]
    if framework is not None:
        pytest.importorskip(framework, reason=f"{framework} is not installed")
    return importlib.import_module(name)


def _documented_names(module_name: str, module) -> list[str]:
    if module_name == "ptxattn":
        return list(ENTRY_POINTS)
    return list(module.__all__)


def _sections(doc: str) -> dict[str, str]:
    """Section title -> body of a numpy-style docstring (cleaned): a title line followed by a
    line of dashes as long as the title."""
    lines = doc.splitlines()
    starts = [(i, lines[i].strip()) for i in range(len(lines) - 1)
              if lines[i].strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip())
              and len(lines[i + 1].strip()) == len(lines[i].strip())]
    sections = {}
    for n, (i, title) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
        sections[title] = "\n".join(lines[i + 2:end])
    return sections


def _parameter_names(body: str) -> set[str]:
    """The names a Parameters or Attributes section documents: its unindented ``name : type``
    (or ``a, b : type``) lines."""
    names = set()
    for line in body.splitlines():
        if line and not line[0].isspace():
            names.update(n.strip() for n in line.split(" : ")[0].split(","))
    return names


def _problems(module, name: str) -> list[str]:
    """What the docstring of ``module.name`` lacks, as messages (empty: none)."""
    obj = getattr(module, name)
    if not callable(obj):
        doc = module.__doc__ or ""
        return [] if re.search(rf"\b{re.escape(name)}\b", doc) else [
            f"constant {name} is not named in {module.__name__}'s docstring"]
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return [f"{name} has no docstring"]
    problems = []
    lines = doc.splitlines()
    if len(lines) > 1 and lines[1].strip():
        problems.append(f"{name}: the summary is not one line followed by a blank line")
    sections = _sections(doc)
    examples = sections.get("Examples", "")
    if ">>>" not in examples:
        problems.append(f"{name}: no Examples section with >>> lines")
    if inspect.isclass(obj):
        if "Parameters" not in sections and "Attributes" not in sections:
            problems.append(f"{name}: a class with neither Parameters nor Attributes")
        return problems
    signature = {p.name for p in inspect.signature(obj).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if "Parameters" not in sections:
        # a function of no parameters has none to document (an empty section is a docs warning)
        if signature:
            return problems + [f"{name}: no Parameters section"]
        sections["Parameters"] = ""
    documented = _parameter_names(sections["Parameters"])
    if documented != signature:
        problems.append(f"{name}: Parameters documents {sorted(documented)}, the signature "
                        f"has {sorted(signature)}")
    if "Returns" not in sections:
        problems.append(f"{name}: no Returns section")
    return problems


@pytest.mark.parametrize("module_name", MODULES)
def test_dir_lists_the_public_api_and_nothing_else(module_name):
    module = _module(module_name)
    assert len(set(module.__all__)) == len(module.__all__), "duplicates in __all__"
    assert dir(module) == sorted(module.__all__)


@pytest.mark.parametrize("module_name", MODULES)
def test_every_name_in_all_exists(module_name):
    module = _module(module_name)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what the module lacks: {missing}"


@pytest.mark.parametrize("module_name", MODULES)
def test_public_names_have_numpy_docstrings(module_name):
    module = _module(module_name)
    problems = [problem for name in _documented_names(module_name, module)
                for problem in _problems(module, name)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module_name", MODULES)
def test_module_docstrings_cite_no_old_paths(module_name):
    """The layout of the reorganised package: docs/guide/ and docs/design/ pages, no
    docs/distributed.md or docs/hopper-tuning.md."""
    doc = _module(module_name).__doc__ or ""
    assert doc.strip(), f"{module_name} has no module docstring"
    for old in ("docs/distributed.md", "docs/blockscaled.md", "docs/hopper-tuning.md"):
        assert old not in doc
