"""``stopcock check``: exit codes, selection, noqa, reporters, notebooks, --fix/--diff, flake8, self-check."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stopcock.cli import main as stopcock_main
from stopcock.lint import check_source
from stopcock.lint.cli import main

ROOT = Path(__file__).resolve().parents[1]

BAD = textwrap.dedent(
    """\
    from diffusers import StableDiffusionPipeline
    from transformers import MaxTimeCriteria, StoppingCriteriaList

    pipe = StableDiffusionPipeline.from_pretrained("x")
    image = pipe(
        "a cat",  # the prompt
        num_inference_steps=30,
        stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(10)]),
    ).images[0]
    pipe("a dog", max_new_tokens=5, guidance_scale=2.0)
    for prompt in ["x", "y"]:
        try:
            pipe(prompt)
        except:
            pass
    """
)


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.py"
    path.write_text(BAD)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_exit_codes_clean_found_and_usage(tmp_path, bad, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text("import stopcock\nprint('fine')\n")
    assert run(capsys, str(clean))[0] == 0
    code, out, err = run(capsys, str(bad))
    assert code == 1 and out.count("STC") == 3 and "3 findings in 1 file (2 fixable with --fix)" in err
    assert f"{bad}:8:5: STC001 `stopping_criteria=`" in out
    assert run(capsys, str(tmp_path / "missing.py"))[0] == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--select", "XYZ1", str(bad)])
    assert exit_info.value.code == 2


def test_the_stopcock_command_runs_check(bad, capsys):
    assert stopcock_main(["check", "--select", "STC008", str(bad)]) == 1
    assert "STC008" in capsys.readouterr().out


def test_select_and_ignore_take_codes_and_prefixes(bad, capsys):
    assert {line.split()[1] for line in run(capsys, "--select", "STC008", str(bad))[1].splitlines()} == {
        "STC008"
    }
    _code, out, _err = run(capsys, "--ignore", "STC00", str(bad))
    assert out == ""
    _code, out, _err = run(capsys, "--select", "STC00", "--ignore", "STC001", str(bad))
    assert "STC001" not in out and "STC008" in out


def test_noqa_bare_and_with_codes(tmp_path, capsys):
    path = tmp_path / "noqa.py"
    path.write_text(
        textwrap.dedent(
            """\
        from diffusers import StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained("x")
        pipe("a", max_time=1)  # noqa
        pipe("b", max_time=1)  # noqa: STC001
        pipe("c", max_time=1)  # noqa:STC002,E501
        pipe("d", max_time=1)  # noqa: E501
        text = "# noqa"; pipe("e", max_time=1)
        """
        )
    )
    _code, out, _err = run(capsys, str(path))
    assert [int(line.split(":")[1]) for line in out.splitlines()] == [5, 6, 7]


def test_json_output(bad, capsys):
    code, out, _err = run(capsys, "--format", "json", str(bad))
    report = json.loads(out)
    assert code == 1 and report["checked"] == 1 and report["errors"] == []
    first = report["findings"][0]
    assert first == {
        "path": str(bad),
        "cell": None,
        "line": 8,
        "column": 5,
        "code": "STC001",
        "name": "generate-args-to-diffusers",
        "message": first["message"],
        "fixable": True,
    }
    assert [f["code"] for f in report["findings"]] == ["STC001", "STC001", "STC008"]


def _validate_sarif(report: dict) -> None:
    schema = json.loads((ROOT / "tests" / "lint_snippets" / "sarif-2.1.0-subset.json").read_text())
    try:
        import jsonschema_rs
    except ImportError:
        jsonschema_rs = None
    if jsonschema_rs is not None:
        jsonschema_rs.validate(schema, report)
    run_ = report["runs"][0]
    assert report["version"] == "2.1.0" and report["$schema"].endswith("sarif-2.1.0.json")
    ids = [r["id"] for r in run_["tool"]["driver"]["rules"]]
    assert ids == [f"STC00{i}" for i in range(1, 9)]
    assert all(r["help"]["text"] and r["shortDescription"]["text"] for r in run_["tool"]["driver"]["rules"])
    for result in run_["results"]:
        assert result["ruleId"] in ids and ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] == "warning" and result["message"]["text"]
        location = result["locations"][0]["physicalLocation"]
        assert not Path(location["artifactLocation"]["uri"]).is_absolute()
        assert location["region"]["startLine"] >= 1


def test_sarif_output_is_valid_with_relative_paths(bad, capsys, monkeypatch):
    monkeypatch.chdir(bad.parent)
    code, out, _err = run(capsys, "--format", "sarif", "bad.py")
    report = json.loads(out)
    assert code == 1
    _validate_sarif(report)
    region = report["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]
    assert region == {"startLine": 8, "startColumn": 5}
    assert (
        report["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        == "bad.py"
    )


def _notebook(tmp_path: Path) -> Path:
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Demo\n"]},
        {
            "cell_type": "code",
            "execution_count": 1,
            "metadata": {},
            "outputs": [],
            "source": [
                "!pip install diffusers\n",
                "%matplotlib inline\n",
                "from diffusers import StableDiffusionPipeline\n",
                "pipe = StableDiffusionPipeline.from_pretrained('x')",
            ],
        },
        {
            "cell_type": "code",
            "execution_count": 2,
            "metadata": {},
            "outputs": [],
            "source": ["%%time\n", "this is not python\n"],
        },
        {
            "cell_type": "code",
            "execution_count": 3,
            "metadata": {},
            "outputs": [],
            "source": [
                "if True:\n",
                "    !nvidia-smi\n",
                "image = pipe('a cat', max_new_tokens=10).images[0]\n",
            ],
        },
    ]
    path = tmp_path / "demo.ipynb"
    path.write_text(
        json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)
    )
    return path


def test_notebooks_report_cell_and_line(tmp_path, capsys):
    path = _notebook(tmp_path)
    code, out, _err = run(capsys, str(path))
    assert code == 1
    assert out.startswith(f"{path}:cell 4, line 3:23: STC001")
    _code, out, _err = run(capsys, "--format", "json", str(path))
    finding = json.loads(out)["findings"][0]
    assert (finding["cell"], finding["line"], finding["column"]) == (4, 3, 23)


def test_notebook_sarif_points_at_the_line_in_the_ipynb(tmp_path, capsys, monkeypatch):
    path = _notebook(tmp_path)
    monkeypatch.chdir(tmp_path)
    report = json.loads(run(capsys, "--format", "sarif", path.name)[1])
    _validate_sarif(report)
    result = report["runs"][0]["results"][0]
    line = result["locations"][0]["physicalLocation"]["region"]["startLine"]
    assert "max_new_tokens=10" in path.read_text().splitlines()[line - 1]
    assert result["message"]["text"].startswith("cell 4, line 3: ")


def test_folders_are_searched_and_unparsable_files_reported(tmp_path, bad, capsys):
    (tmp_path / "broken.py").write_text("def (:\n")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("")
    (venv / "lib.py").write_text(BAD)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.py").write_text(BAD)
    code, out, err = run(capsys, str(tmp_path))
    assert code == 1 and {Path(line.split(":")[0]).name for line in out.splitlines()} == {"bad.py"}
    assert "broken.py: cannot parse" in err


def test_diff_shows_the_fix_and_changes_nothing(bad, capsys):
    code, out, _err = run(capsys, "--diff", str(bad))
    assert code == 1 and bad.read_text() == BAD
    assert "+image = stopcock.run(pipe," in out and "+import stopcock" in out
    assert "-    stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(10)])," in out
    assert "+    num_inference_steps=30, stop=stopcock.timeout(10)," in out


def test_fix_rewrites_into_code_that_parses_and_no_longer_triggers(bad, capsys):
    code, _out, err = run(capsys, "--fix", str(bad))
    fixed = bad.read_text()
    ast.parse(fixed)
    assert code == 1 and "1 finding in 1 file" in err  # the bare except is not fixable
    assert [f.code for f in check_source(fixed)] == ["STC008"]
    assert '    "a cat",  # the prompt\n' in fixed  # untouched text keeps its comments and layout
    assert ").output.images[0]" in fixed and "import stopcock\n" in fixed
    assert "# TODO(stopcock): max_new_tokens= never reached this pipeline" in fixed
    assert 'pipe("a dog", guidance_scale=2.0)' in fixed


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("pipe('a', max_time=3)", "stopcock.run(pipe, 'a', stop=stopcock.timeout(3)).output"),
        ("pipe(max_time=3)", "stopcock.run(pipe, stop=stopcock.timeout(3)).output"),
        ("pipe(max_time=t, prompt='a')", "stopcock.run(pipe, prompt='a', stop=stopcock.timeout(t)).output"),
        ("pipe(max_new_tokens=3, prompt='a',)", "pipe(prompt='a',)"),
        ("pipe('a', streamer=s, max_length=9)", "pipe('a')"),
    ],
)
def test_fix_cuts_arguments_cleanly(call, expected):
    from stopcock.lint.rewrite import apply_fixes

    source = (
        "from diffusers import StableDiffusionPipeline\npipe = StableDiffusionPipeline.from_pretrained('x')\n"
    )
    fixed, count = apply_fixes(source + call + "\n", check_source(source + call + "\n"))
    assert count == 1 and expected in fixed and check_source(fixed) == []


def test_fix_of_an_unknown_class_only_removes_and_leaves_a_todo(tmp_path, capsys):
    path = tmp_path / "auto.py"
    path.write_text(
        "from diffusers import DiffusionPipeline\np = DiffusionPipeline.from_pretrained('x')\n"
        "if True: p('a', max_time=4)\n"
    )
    run(capsys, "--fix", str(path))
    fixed = path.read_text()
    assert "# TODO(stopcock): max_time= never reached this pipeline" in fixed and "p('a')" in fixed
    ast.parse(fixed)


def test_explain_and_list_rules(capsys):
    code, out, _err = run(capsys, "--explain", "stc005")
    assert (
        code == 0
        and out.startswith("## STC005 unstoppable-streamer")
        and "huggingface/transformers#27927" in out
    )
    assert run(capsys, "--explain", "STC099")[0] == 2
    code, out, _err = run(capsys, "--list-rules")
    assert code == 0 and len(out.splitlines()) == 8


def test_flake8_runs_the_rules_through_its_entry_point(tmp_path):
    path = tmp_path / "snippet.py"
    path.write_text(
        BAD.replace(
            'pipe("a dog", max_new_tokens=5, guidance_scale=2.0)',
            'pipe("a dog", max_new_tokens=5)  # noqa: STC001',
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "--select", "STC", str(path)], capture_output=True, text=True
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stderr
    assert [line.split(": ")[1].split()[0] for line in lines] == ["STC001", "STC008"]
    assert lines[0].startswith(f"{path}:8:5: STC001")


def test_the_linter_imports_no_heavy_library_nor_the_cli():
    code = (
        "import sys, stopcock.lint.cli, stopcock.lint.flake8; from stopcock.lint import check_source;"
        " check_source(open(sys.argv[1]).read());"
        " print([m for m in ('torch', 'diffusers', 'transformers', 'stopcock.cli', 'stopcock.server')"
        " if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__))], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_this_repository_has_no_findings():
    """The project's tests, benchmarks, package and README code blocks are clean."""
    result = subprocess.run(
        [sys.executable, "-m", "stopcock.lint", "tests", "bench", "stopcock"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 5
    assert [(i, f) for i, block in enumerate(blocks) for f in check_source(block)] == []
