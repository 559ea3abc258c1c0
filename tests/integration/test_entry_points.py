"""How chunkce meets torch, each in a fresh process: importing the package changes no
Dynamo setting, ``backend="chunkce"`` resolves through Dynamo's own lookup with or
without install metadata, and the first use installs the logging scope for every
thread (:mod:`compile_pass.dynamo_scope`); and the entry point pyproject.toml declares is
the one installed and the one a source checkout's stand-in loads."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WITHOUT_METADATA = """
    import importlib.metadata as md
    _entry_points = md.entry_points

    def entry_points(**kwargs):  # a source checkout: no installed chunkce entry point
        found = _entry_points(**kwargs)
        if kwargs.get("group") != "torch_dynamo_backends":
            return found
        return md.EntryPoints(tuple(ep for ep in found if ep.name != "chunkce"))

    md.entry_points = entry_points
"""


def run_fresh(script: str) -> None:
    """Run ``script`` in a new interpreter (the op's kernels eager); it must print ``ok`` last."""
    env = {**os.environ, "CHUNKCE_EAGER_KERNELS": "1"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1:] == ["ok"], result.stdout[-2000:]


@pytest.mark.slow
def test_import_changes_no_dynamo_setting_and_the_first_compile_installs_the_scope():
    run_fresh("""
        import sys
        import torch
        import torch._dynamo.config as config

        def settings():
            values = {name: (type(v), v) for name, v in config.get_config_copy().items()}
            return values, {name: type(entry.default) for name, entry in config._config.items()}

        before = settings()
        import compile_pass
        h, w, target = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 4])
        compile_pass.linear_cross_entropy(h, w, target)  # the eager op
        assert settings() == before
        assert "compile_pass.backend" not in sys.modules

        torch.compile(torch.nn.Linear(3, 5), backend="chunkce")  # Dynamo imports the backend: first use
        from compile_pass.dynamo_scope import _ScopedIgnoreSet
        assert "compile_pass.backend" in sys.modules
        assert isinstance(config.ignore_logging_functions, _ScopedIgnoreSet)
        assert isinstance(config._config["ignore_logging_functions"].default, _ScopedIgnoreSet)
        print("ok")
    """)


@pytest.mark.slow
@pytest.mark.parametrize(("metadata", "first"), [("installed", "lookup"), ("installed", "list"), ("installed", "import"),
                                                 ("absent", "lookup"), ("absent", "list")])
def test_dynamo_lookup_finds_chunkce(metadata, first):
    """Installed: the distribution's entry point, loaded by Dynamo's lookup, with or without an
    earlier ``import compile_pass`` (no duplicate registration either way). Absent (a source
    checkout): the stand-in that ``import compile_pass`` registers, which imports the backend
    at its first compile."""
    prelude = WITHOUT_METADATA if metadata == "absent" else ""
    if metadata == "absent" or first == "import":
        prelude += "\n    import compile_pass\n"
    run_fresh(prelude + f"""
    import sys
    import torch
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    if {first!r} == "list":
        assert "chunkce" in list_backends()
    backend = lookup_backend("chunkce")
    assert ("compile_pass.backend" in sys.modules) == ({metadata!r} == "installed")
    compiled = torch.compile(lambda x: x.sin() + 1, backend="chunkce", options={{"inner_backend": "eager"}})
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x.sin() + 1)
    import compile_pass.backend
    if {metadata!r} == "installed":
        assert backend is compile_pass.backend.chunkce_backend is compile_pass.chunkce_backend
    assert "chunkce" in list_backends() and lookup_backend("chunkce") is backend
    assert "chunkce" in torch._dynamo.list_backends()
    print("ok")
    """)


@pytest.mark.slow
def test_scope_reaches_every_thread_that_compiles():
    """A thread started after the first use reads the scoped set; a thread that read the set
    before it has it wrapped by its own first chunkce compile (its first frame traced as stock)."""
    run_fresh("""
        import threading
        import torch
        import torch.nn.functional as F
        import transformers.utils.logging as hf_logging
        from torch._dynamo.utils import counters
        import compile_pass

        logger = hf_logging.get_logger("compile_pass.tests")

        class WarnsBeforeLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lm_head = torch.nn.Linear(8, 11, bias=False)

            def forward(self, h, labels):
                logits = self.lm_head(h)
                logger.warning_once("chunkce test: a one-shot advisory in the loss path")
                return F.cross_entropy(logits.view(-1, 11), labels.view(-1))

        h, labels = torch.randn(2, 3, 8), torch.randint(0, 11, (2, 3))
        results = {}

        def step(name, backend, options=None):  # distinct options: Dynamo traces afresh, not a cache hit
            counters.clear()
            torch.compile(WarnsBeforeLoss(), backend=backend, options=options)(h, labels)
            results[name] = (dict(counters["graph_break"]), counters["chunkce"]["sites_rewritten"])

        def in_thread(fn, *args):
            thread = threading.Thread(target=fn, args=args)
            thread.start()
            thread.join()

        read, first_use_done = threading.Event(), threading.Event()

        def early_reader():  # reads the set before chunkce's first use, compiles after it
            type(torch._dynamo.config.ignore_logging_functions)
            read.set()
            first_use_done.wait()
            results["early_type"] = type(torch._dynamo.config.ignore_logging_functions).__name__
            step("early_first", "chunkce", {"inner_backend": "aot_eager", "chunk_size": 1})
            results["early_after"] = type(torch._dynamo.config.ignore_logging_functions).__name__

        early = threading.Thread(target=early_reader)
        early.start()
        read.wait()
        torch.compile(WarnsBeforeLoss(), backend="chunkce")  # first use, on the main thread
        first_use_done.set()
        early.join()
        in_thread(step, "late", "chunkce", {"inner_backend": "aot_eager", "chunk_size": 2})
        in_thread(step, "stock", "aot_eager")

        assert results["early_type"] == "set" and results["early_after"] == "_ScopedIgnoreSet", results
        assert results["late"] == ({}, 1), results["late"]
        breaks, rewritten = results["stock"]
        assert breaks and rewritten == 0, results["stock"]
        print("ok")
    """)


def test_declared_installed_and_source_entry_points_agree():
    """pyproject.toml's entry point, the installed distribution's and the one ``import
    compile_pass``'s stand-in loads are one: an edited pyproject with a stale install (or the reverse)
    fails here, not in a user's first compile."""
    from importlib.metadata import entry_points

    import tomllib

    import compile_pass

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["torch_dynamo_backends"] == {"chunkce": compile_pass.BACKEND_ENTRY_POINT.value}
    (installed,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "chunkce"]
    assert installed == compile_pass.BACKEND_ENTRY_POINT
    module, _, attribute = installed.value.partition(":")
    assert callable(getattr(importlib.import_module(module), attribute))
