"""The throwaway virtualenv for NVIDIA's ``kvpress`` and the bridge to ``_kvpress_worker.py`` running inside it.

kvpress 0.5.5 pins ``transformers<5.3`` (it resolves to 5.2.0) while sinklab's own venv runs a newer transformers, so
the kvpress side of a benchmark runs in its own venv: ``kvpress_python()`` builds it once (CPU torch only, never a
CUDA wheel) and ``run_worker()`` hands the worker one JSON job and reads back its JSON-lines rows.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_kvpress_worker.py"
DEFAULT_VENV = Path("/tmp/sinklab-kvpress-venv")
TORCH = "torch==2.13.0"
KVPRESS = "kvpress==0.5.5"
PIP_TIMEOUT_S = 1800.0

_PROBE = (
    "import json, kvpress, torch, transformers; from importlib.metadata import version; "
    "print(json.dumps({'kvpress': version('kvpress'), 'transformers': transformers.__version__, "
    "'torch': torch.__version__, 'cuda': torch.version.cuda}))"
)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(cmd: list[str], timeout: float = PIP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _probe(python: Path) -> dict | None:
    """Versions seen by ``python`` when it imports kvpress, transformers and torch; None if that fails."""
    if not python.exists():
        return None
    try:
        res = _run([str(python), "-c", _PROBE], timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _cpu_torch_planned(python: Path) -> str | None:
    """Why pip must not install ``TORCH`` here (it would fetch a CUDA build), or None when it resolves to ``+cpu``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        res = _run([str(python), "-m", "pip", "install", "-q", "--dry-run", "--only-binary=torch", "--report",
                    str(report), TORCH])
        if res.returncode != 0:
            return f"pip cannot resolve {TORCH}: {_tail(res.stderr, 5)}"
        try:
            plan = json.loads(report.read_text())["install"]
        except (OSError, ValueError, KeyError):
            return "pip gave no install report for torch"
    versions = [p["metadata"]["version"] for p in plan if p["metadata"]["name"].lower() == "torch"]
    if versions and "+cpu" not in versions[0]:
        return f"pip would install torch {versions[0]}, not a +cpu build (no local CPU wheel); refusing a CUDA torch"
    return None


def _note(info: dict) -> str:
    return f"kvpress {info['kvpress']}, transformers {info['transformers']}, torch {info['torch']}"


def kvpress_python(venv: Path = DEFAULT_VENV, build: bool = True) -> tuple[Path | None, str]:
    """The Python of a venv with kvpress 0.5.5 on CPU torch, built on first use, and a note of its versions.

    Creates ``venv`` if needed (``python -m venv``, then ``pip install torch==2.13.0``, then
    ``pip install kvpress==0.5.5``, which brings transformers 5.2.0, accelerate, peft and datasets), checks that
    ``import kvpress, transformers`` works there and returns ``(python, "kvpress 0.5.5, transformers 5.2.0, torch
    2.13.0+cpu")``. Never raises: returns ``(None, reason)`` when the venv cannot be built, including when pip would
    have to fetch a CUDA build of torch. ``build=False`` only looks: ``(None, reason)`` when the venv is not ready.
    """
    venv = Path(venv)
    python = venv / "bin" / "python"
    info = _probe(python)
    if info is not None:
        return python, _note(info)
    if not build:
        return None, f"no working kvpress venv at {venv} (build it with --build-kvpress)"
    try:
        if not python.exists():
            res = _run([sys.executable, "-m", "venv", str(venv)], timeout=600)
            if res.returncode != 0:
                return None, f"python -m venv {venv} failed: {_tail(res.stderr, 5)}"
        why = _cpu_torch_planned(python)
        if why is not None:
            return None, why
        res = _run([str(python), "-m", "pip", "install", "-q", "--only-binary=torch", TORCH])
        if res.returncode != 0:
            return None, f"pip install {TORCH} failed: {_tail(res.stderr, 5)}"
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
            pin.write(f"{TORCH}\n")  # kvpress must not swap the CPU torch for another build
        try:
            res = _run([str(python), "-m", "pip", "install", "-q", "-c", pin.name, KVPRESS])
        finally:
            os.unlink(pin.name)
        if res.returncode != 0:
            return None, f"pip install {KVPRESS} failed: {_tail(res.stderr, 5)}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"building {venv} failed: {exc}"
    info = _probe(python)
    if info is None:
        return None, f"{venv} was built but `import kvpress, transformers, torch` fails there"
    if info.get("cuda"):
        return None, f"{venv} has a CUDA torch ({info['torch']}); expected a CPU build"
    return python, _note(info)


def run_worker(python: Path, job: dict, timeout: float, echo: bool = True) -> list[dict]:
    """Run ``_kvpress_worker.py`` on ``job`` with the kvpress venv's ``python``; its JSON-lines rows, in order.

    The job goes through a temporary JSON file; the worker runs offline (``HF_HUB_OFFLINE=1``) with
    ``OMP_NUM_THREADS`` set to ``job["threads"]`` and without this process's ``PYTHONPATH`` (it must not see
    sinklab). Its stderr (progress lines, logs) is echoed to ours when ``echo``. Raises ``RuntimeError`` with the
    tail of that stderr when the worker fails, times out or prints a line that is not JSON.
    """
    threads = str(int(job.get("threads", 1)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS=threads,
               MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="kvpress-job-", delete=False) as fh:
        json.dump(job, fh)
        job_path = fh.name
    tail: collections.deque[str] = collections.deque(maxlen=40)
    out: list[str] = []

    def pump_err(stream) -> None:
        for line in stream:
            tail.append(line.rstrip("\n"))
            if echo:
                print(line, end="", file=sys.stderr, flush=True)

    try:
        proc = subprocess.Popen([str(python), str(WORKER), job_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        readers = [threading.Thread(target=pump_err, args=(proc.stderr,), daemon=True),
                   threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"kvpress worker timed out after {timeout:.0f} s:\n" + "\n".join(tail)) from None
        finally:
            for reader in readers:
                reader.join(10)
    finally:
        os.unlink(job_path)
    if proc.returncode != 0:
        raise RuntimeError(f"kvpress worker exited with {proc.returncode}:\n" + "\n".join(tail))
    rows = []
    for line in out:
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise RuntimeError(f"kvpress worker printed a non-JSON line {line[:200]!r}:\n" + "\n".join(tail)) from None
    return rows
