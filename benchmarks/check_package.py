"""Release check (not a unit test — a fresh venv takes minutes): build, inspect and install the package.

1. ``python -m build`` (in a throwaway venv with ``build``) writes a wheel and an sdist to a temp folder;
2. the wheel's metadata must carry the licence, classifiers and the ``sinklab`` console
   script (project URLs are reported: none is declared yet), and the wheel must contain builtin:tiny-lm's data files (config, weights, tokenizer) and ``py.typed``;
3. the sdist must contain the same data files, the licence and the docs;
4. a second fresh venv installs the wheel (with its dependencies, from the package index) and runs
   ``sinklab --version`` (if the CLI has it) and ``sinklab scan builtin:tiny-lm`` offline.

    python benchmarks/check_package.py [--keep DIR] [--no-install]

Prints one line per check and exits 1 if any fails (the work folder is then kept and named; a passing run removes
it unless ``--keep``). A CI step (``make check-package``).
"""

from __future__ import annotations

import argparse
import email
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    print("  $", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=kwargs.pop("check", False),
                          **kwargs)


def venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    ap.add_argument("--torch", default="torch==2.13.0", help="torch requirement installed first (CPU wheel)")
    ap.add_argument("--no-install", action="store_true", help="build and inspect only (skip the fresh install)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="sinklab-package-"))
    work.mkdir(parents=True, exist_ok=True)
    code = _checks(args, work)
    if code == 0 and args.keep is None:  # a passing run leaves no virtualenvs behind
        shutil.rmtree(work, ignore_errors=True)
    return code


def _checks(args: argparse.Namespace, work: Path) -> int:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("  ok   " if ok else "  FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    print("build", flush=True)
    py = venv(work / "build-venv")
    run([py, "-m", "pip", "install", "-q", "build"], check=True)
    res = run([py, "-m", "build", "--outdir", work / "dist", ROOT])
    check(res.returncode == 0, "python -m build" + ("" if res.returncode == 0 else ": " + res.stderr[-2000:]))
    if res.returncode:
        return 1
    wheel = next((work / "dist").glob("sinklab-*.whl"))
    sdist = next((work / "dist").glob("sinklab-*.tar.gz"))

    print("wheel metadata", flush=True)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_string(zf.read(meta_name).decode())
        entry = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    check(meta.get("License-Expression") == "Apache-2.0" or "Apache" in (meta.get("License") or ""), "licence Apache-2.0")
    check(any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("LICENSE") for n in names), "LICENSE file in wheel")
    check(len(meta.get_all("Classifier") or []) >= 3, f"classifiers ({len(meta.get_all('Classifier') or [])})")
    urls = meta.get_all("Project-URL")
    # No public repository or documentation site exists yet: report it, do not invent one.
    print(("  ok   " if urls else "  note ") + f"project URLs ({urls or 'none declared: no public repository yet'})")
    check("sinklab = sinklab.cli:main" in entry, "console script sinklab → sinklab.cli:main")
    for f in DATA:
        check(any(n.startswith("sinklab/data/") and n.endswith("/" + f) for n in names), f"wheel has tiny-lm {f}")
    check("sinklab/py.typed" in names, "wheel has py.typed (PEP 561: the package's type hints are for its users)")

    print("sdist contents", flush=True)
    with tarfile.open(sdist) as tf:
        snames = tf.getnames()
    for f in DATA:
        check(any("/src/sinklab/data/" in n and n.endswith("/" + f) for n in snames), f"sdist has tiny-lm {f}")
    check(any(n.endswith("/LICENSE") for n in snames), "sdist has LICENSE")

    if args.no_install:
        print(f"{'all checks passed' if not failures else f'{len(failures)} check(s) failed'} (no install"
              + (")" if not failures and args.keep is None else f"; {work})"))
        return 1 if failures else 0
    print("fresh install", flush=True)
    ipy = venv(work / "install-venv")
    res = run([ipy, "-m", "pip", "install", "-q", args.torch])
    check(res.returncode == 0, f"install {args.torch}" + ("" if res.returncode == 0 else ": " + res.stderr[-1500:]))
    res = run([ipy, "-m", "pip", "install", "-q", wheel])
    check(res.returncode == 0, "pip install the wheel" + ("" if res.returncode == 0 else ": " + res.stderr[-1500:]))
    if failures:  # nothing installed to run
        print(f"{len(failures)} check(s) failed; the install did not complete (work folder {work})")
        return 1
    cli = work / "install-venv" / "bin" / "sinklab"
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    res = run([cli, "--help"], env=env, cwd=work)
    check(res.returncode == 0, "sinklab --help")
    if "--version" in res.stdout:
        res = run([cli, "--version"], env=env, cwd=work)
        check(res.returncode == 0 and "0." in res.stdout, f"sinklab --version → {res.stdout.strip()!r}")
    else:
        print("  skip sinklab --version (this CLI has no --version yet)")
    res = run([cli, "scan", "builtin:tiny-lm", "--out", work / "scan-out"], env=env, cwd=work)
    check(res.returncode == 0 and (work / "scan-out" / "scan.json").is_file(),
          "sinklab scan builtin:tiny-lm" + ("" if res.returncode == 0 else ": " + res.stderr[-1500:]))
    print(f"{'all checks passed' if not failures else f'{len(failures)} check(s) failed'}"
          + ("" if not failures and args.keep is None else f" (work folder {work})"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
