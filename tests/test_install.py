"""The install: the core imports without the heavy libraries, the lazily loaded names have their real
types for a user's type checker, one version source, and the files a release needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stopcock

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter: every heavy library raises ImportError, as where it is not installed.
WITHOUT_HEAVY = """
import importlib.abc, sys

HEAVY = {"torch", "transformers", "diffusers", "accelerate", "safetensors", "numpy", "PIL", "tokenizers",
         "huggingface_hub", "fastapi", "starlette", "uvicorn", "ray", "gradio"}

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Missing())

import threading
import stopcock

signal = stopcock.StopSignal()
condition = stopcock.AnyOf(stopcock.timeout(60), stopcock.max_steps(3))
threading.Thread(target=signal.stop, args=("user",)).start()
assert signal.wait(10), "the signal was not set"
assert (signal.stopped, signal.reason) == (True, "user"), (signal.stopped, signal.reason)
assert isinstance(condition, stopcock.Condition)
assert condition.check(stopcock.StepState(step=2)) is None
assert condition.check(stopcock.StepState(step=3)) == "max_steps"
try:
    stopcock.attach
except ImportError as exc:
    assert "diffusers" in str(exc) or "torch" in str(exc), exc
else:
    raise AssertionError("stopcock.attach imported without torch")
print("imported", stopcock.__version__, sorted(m for m in sys.modules if m.partition(".")[0] in HEAVY))
"""


@pytest.mark.timeout(60)
def test_import_stopcock_and_use_a_signal_and_conditions_without_any_heavy_library():
    done = subprocess.run([sys.executable, "-c", WITHOUT_HEAVY], cwd=ROOT, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"imported {stopcock.__version__} []"


USER_FILE = """
import stopcock

reveal_type(stopcock.arun)
reveal_type(stopcock.attach)
reveal_type(stopcock.Checkpoint.load)
reveal_type(stopcock.astream)
reveal_type(stopcock.stopping_criteria)
reveal_type(stopcock.__version__)
"""

# The user's project: stopcock as an installed package (its own errors are not the user's), and the
# heavy libraries not analysed (their types are Any here; stopcock's own types are what is checked).
USER_CONFIG = """
[mypy]
ignore_missing_imports = True
[mypy-stopcock.*]
ignore_errors = True
[mypy-torch.*,transformers.*,diffusers.*,safetensors.*,numpy.*,PIL.*,accelerate.*,huggingface_hub.*,tokenizers.*]
follow_imports = skip
"""


@pytest.mark.timeout(300)
def test_a_users_mypy_sees_the_real_types_of_the_lazily_loaded_names(tmp_path: Path):
    (tmp_path / "user.py").write_text(USER_FILE)
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(USER_CONFIG))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache"),
         "user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env={"MYPYPATH": str(ROOT), "PATH": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    revealed = [line.split("Revealed type is ", 1)[1] for line in done.stdout.splitlines()
                if "Revealed type is" in line]
    assert len(revealed) == 6, done.stdout
    arun, attach, load, astream, criteria, version = revealed
    assert arun.startswith('"def (target: Any') and "Coroutine[Any, Any, stopcock.outcome.Outcome]" in arun
    assert "stop: stopcock.signal.StopSignal | stopcock.conditions.Condition" in attach
    assert "_GeneratorContextManager[stopcock.adapters.diffusers.Handle" in attach
    assert load == '"def (path: str | os.PathLike[str]) -> stopcock.checkpoint.Checkpoint"'
    assert astream.endswith('-> stopcock.aio.AsyncStream"')
    assert criteria.startswith('"def (stop: stopcock.signal.StopSignal')
    assert version == '"str"'


def test_one_version_source():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "stopcock._version.__version__"}
    from stopcock._version import __version__

    assert stopcock.__version__ == __version__


def test_license_is_the_apache_2_text_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability." in text


def test_changelog_has_the_current_versions_section():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog")
    assert "## [Unreleased]" in changelog
    assert f"## [{stopcock.__version__}]" in changelog


def test_every_lazy_name_has_its_type_checking_import():
    import ast

    from stopcock import _LAZY

    tree = ast.parse((ROOT / "stopcock" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    for alias in imp.names:  # ``X as X``: an explicit re-export
                        assert alias.asname == alias.name, alias.name
                        typed[alias.name] = f"stopcock.{imp.module}"
    assert typed == _LAZY  # each lazy name, imported for type checkers from the module it loads from
