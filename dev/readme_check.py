"""A new user's first run, as the README writes it: its install line in a fresh venv with a fresh home directory,
then its "Use" snippet, run from a directory outside the clone. Exits non-zero when either fails (CI runs it).

    python dev/readme_check.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def block(text: str, section: str, language: str) -> str:
    """The first fenced ``language`` block after the heading ``section`` of ``text``."""
    start = text.index(f"\n## {section}\n")
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(text, start)
    if match is None:
        raise SystemExit(f"README: no ```{language} block under '## {section}'")
    return match.group(1).strip()


def main() -> int:
    """Install and run as the README says; print each step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install, snippet = block(readme, "Install", "bash"), block(readme, "Use", "python")
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf_eagle3_readme_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _check(work, install, snippet)
    finally:
        if not args.keep:  # several GB (torch): never left behind, also when a step fails or is interrupted
            shutil.rmtree(work, ignore_errors=True)


def _check(work: Path, install: str, snippet: str) -> int:
    """Install with ``install`` into a fresh venv and home under ``work``, then run ``snippet`` from that home."""
    venv, home = work / "venv", work / "home"
    home.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The machine's settings a new user has too (package index, proxies, certificates), nothing of this checkout's.
    keep = {"PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"}
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    env.update(HOME=str(home), VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    print(f"readme check: install line, fresh venv {venv}, HOME={home}:\n  {install}", flush=True)
    subprocess.run(["bash", "-c", install], cwd=ROOT, env=env, check=True)
    print("readme check: the Use snippet, run from a directory outside the clone", flush=True)
    result = subprocess.run([str(venv / "bin" / "python"), "-c", snippet], cwd=home, env=env)
    print(f"readme check: {'passed' if result.returncode == 0 else 'FAILED'} ({work})", flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
