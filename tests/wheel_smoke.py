"""The release smoke test (``make wheel-smoke``, part of ``make test``): the built wheel and sdist hold
every file of the package, and the wheel, installed into a fresh venv, works from outside the checkout.

    python tests/wheel_smoke.py DIST_FOLDER

1. The wheel and the sdist list every file of the checkout's ``stopcock/`` (code, the demo models'
   weights and tokenizers, the web page, ``py.typed``), the launcher module and the licence.
2. A fresh venv gets the wheel with no extra: ``import stopcock`` with a ``StopSignal`` and the
   conditions works there, and torch is not installed.
3. The same venv gets torch (``TORCH``, default ``torch==2.13.0``, installed first so that pip takes
   the CPU build) and the ``all`` extra; from a temporary folder (so the checkout is not on
   ``sys.path``): ``stopcock demo``, the ``text`` and ``image`` commands with a stop, and ``stopcock
   serve`` answering its page, its OpenAPI schema and its offline API docs.

Every step is bounded by a timeout; the first failure ends the script with exit code 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = os.environ.get("TORCH", "torch==2.13.0")
INSTALL_TIMEOUT = 900  # seconds for one pip install (the extras are a few hundred MB on a cold cache)
RUN_TIMEOUT = 300


class SmokeFailed(Exception):
    pass


def say(text: str) -> None:
    print(f"wheel-smoke: {text}", flush=True)


def package_files() -> set[str]:
    """The checkout's package files, as paths inside a wheel."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "stopcock").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    return files | {"_stopcock_launch.py"}


def check_archives(dist: Path) -> tuple[Path, Path]:
    wheels, sdists = sorted(dist.glob("stopcock-*.whl")), sorted(dist.glob("stopcock-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise SmokeFailed(f"{dist} must hold one wheel and one sdist, found {wheels + sdists}")
    wheel, sdist = wheels[0], sdists[0]
    expected = package_files()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = sorted(expected - names)
    if missing:
        raise SmokeFailed(f"{wheel.name} lacks {missing}")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        raise SmokeFailed(f"{wheel.name} lacks the LICENSE")
    with tarfile.open(sdist) as t:
        top = sdist.name.removesuffix(".tar.gz")
        in_sdist = {n.removeprefix(f"{top}/") for n in t.getnames()}
    missing = sorted((expected | {"LICENSE", "pyproject.toml", "README.md"}) - in_sdist)
    if missing:
        raise SmokeFailed(f"{sdist.name} lacks {missing}")
    say(f"{wheel.name} and {sdist.name} hold the package's {len(expected)} files and the licence")
    return wheel, sdist


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = RUN_TIMEOUT) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SmokeFailed(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                          f"{done.stderr[-3000:]}")
    return done.stdout


BARE = """
import importlib.util, sys
import stopcock
assert importlib.util.find_spec("torch") is None, "torch is installed"
assert "site-packages" in stopcock.__file__, stopcock.__file__
signal = stopcock.StopSignal()
condition = stopcock.timeout(60) | stopcock.max_steps(3)
assert condition.check(stopcock.StepState(step=3)) == "max_steps"
assert signal.stop("user") and signal.reason == "user"
print(stopcock.__version__)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode("utf-8"))


def check_serve(bin_dir: Path, cwd: Path, env: dict[str, str]) -> None:
    port = free_port()
    server = subprocess.Popen([str(bin_dir / "stopcock"), "serve", "--port", str(port)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        assert server.stdout is not None
        for line in server.stdout:  # the server says when it listens
            if "running on http://" in line:
                break
            if time.monotonic() > deadline:
                raise SmokeFailed("stopcock serve did not start")
        else:
            raise SmokeFailed(f"stopcock serve ended with exit code {server.wait()}")
        base = f"http://127.0.0.1:{port}"
        page, docs = get(f"{base}/"), get(f"{base}/docs")
        schema = json.loads(get(f"{base}/openapi.json"))
        if "<title>stopcock</title>" not in page or "/v1/jobs" not in schema["paths"]:
            raise SmokeFailed("stopcock serve: the page or the schema is not the one shipped")
        if "https://" in docs or "http://" in docs:
            raise SmokeFailed(f"stopcock serve: /docs refers to another host:\n{docs}")
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            if asset not in docs:
                raise SmokeFailed(f"stopcock serve: /docs does not load {asset}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    say("stopcock serve: its page, its schema and its offline API docs")


def main(dist: Path) -> int:
    wheel, _ = check_archives(dist)
    with tempfile.TemporaryDirectory(prefix="stopcock-wheel-") as tmp:
        where = Path(tmp)
        env_dir, work = where / "venv", where / "work"
        work.mkdir()
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        bin_dir = env_dir / "bin"
        python = str(bin_dir / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]

        run([*pip, str(wheel)], work, env, INSTALL_TIMEOUT)
        version = run([python, "-c", BARE], work, env).strip()
        say(f"the bare wheel ({version}, no torch): import stopcock, a StopSignal and conditions work")

        started = time.monotonic()
        run([*pip, TORCH], work, env, INSTALL_TIMEOUT)
        run([*pip, f"{wheel}[all]"], work, env, INSTALL_TIMEOUT)
        say(f"installed {TORCH} and the 'all' extra in {time.monotonic() - started:.0f} s")

        demo = run([str(bin_dir / "stopcock"), "demo", "--out", str(work / "demo.png")], work, env)
        if "Every run ended for the reason it should" not in demo or not (work / "demo.png").is_file():
            raise SmokeFailed(f"stopcock demo did not finish as it must:\n{demo}")
        say("stopcock demo: every run ended for the reason it should")

        text = text_json(bin_dir, work, env)
        image = image_json(bin_dir, work, env)
        say(f"stopcock text: {text['reason']} after {text['steps']} tokens; stopcock image: {image['reason']}"
            f" at step {image['steps']}, {image['image']} image saved")

        check_serve(bin_dir, work, env)
    return 0


def _json_of(cmd: list[str], cwd: Path, env: dict[str, str], code: int) -> dict[str, object]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if done.returncode != code:
        raise SmokeFailed(f"{' '.join(cmd)} exited {done.returncode}, not {code}:\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout)
    return result


def text_json(bin_dir: Path, work: Path, env: dict[str, str]) -> dict[str, object]:
    command = [str(bin_dir / "stopcock"), "text", "--prompt", "Beautiful is", "--stop", ".", "--json"]
    result = _json_of(command, work, env, 3)
    if result["reason"] != "stop_string" or not str(result["text"]).endswith("."):
        raise SmokeFailed(f"stopcock text did not stop at the stop string: {result}")
    return result


def image_json(bin_dir: Path, work: Path, env: dict[str, str]) -> dict[str, object]:
    out = work / "seven.png"
    command = [str(bin_dir / "stopcock"), "image", "--prompt", "7", "--steps", "8", "--stop-at-step", "4",
               "--out", str(out), "--json"]
    result = _json_of(command, work, env, 3)
    got = (result["reason"], result["steps"], result["image"])
    if got != ("max_steps", 4, "partial") or not out.is_file():
        raise SmokeFailed(f"stopcock image did not stop at step 4 with a partial image: {result}")
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        sys.exit(main(Path(sys.argv[1]).resolve()))
    except (SmokeFailed, subprocess.TimeoutExpired) as exc:
        print(f"wheel-smoke: FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
