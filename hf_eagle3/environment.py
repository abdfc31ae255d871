"""The record of where and with what a benchmark ran: date, command, CPU flags, versions, dtype, device, the draft's
revision. Every benchmark report stores one under ``"settings"`` so that each number traces to its machine and draft."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
from pathlib import Path

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo(path: str | os.PathLike) -> tuple[str, set[str]] | None:
    """The first ``model name`` and ``flags`` lines of a ``cpuinfo`` file, read once; ``None`` when unreadable."""
    model, flags = "", None
    try:
        with open(path) as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif flags is None and line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if model and flags is not None:
                    break
    except OSError:
        return None
    return (model, flags) if flags is not None else None


def cpu_flags(path: str | os.PathLike = "/proc/cpuinfo") -> set[str] | None:
    """The CPU feature flags the kernel reports.

    Args:
        path: the ``cpuinfo`` file (Linux).

    Returns:
        The flags of the first ``flags`` line, or ``None`` when the file cannot be read (not Linux).
    """
    info = _cpuinfo(path)
    return None if info is None else info[1]


def cpu_description(path: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's model name and the flags that decide fp32 / bf16 speed (AVX2, AVX-512, bf16, AMX), for reports.

    Args:
        path: the ``cpuinfo`` file (Linux).

    Returns:
        e.g. ``"AMD EPYC 9B14 | avx2 avx512f avx512_bf16"``; the platform's processor name where the file is missing.
    """
    info = _cpuinfo(path)
    if info is None:
        return platform.processor() or platform.machine()
    model, flags = info
    wanted = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + ", ".join(CPU_FLAGS)
    return f"{model} | {wanted}" if model else wanted


def draft_revision(draft_path: str | os.PathLike | None) -> str | None:
    """The revision of a local draft: the first 12 hex digits of the SHA-256 of its weight files, in name order.

    Args:
        draft_path: the draft's folder (or ``None`` for a random draft).

    Returns:
        The digest prefix, or ``None`` when the path is not a local folder with ``*.safetensors`` files.
    """
    if draft_path is None or not Path(draft_path).is_dir():
        return None
    files = sorted(Path(draft_path).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def code_commit() -> str | None:
    """The git commit of the checkout the package runs from (``+dirty`` when it has uncommitted changes), or ``None``
    outside a git checkout (an installed wheel)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "hf_eagle3"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty else "")


def environment_record(target=None, command: str | None = None, draft_path: str | os.PathLike | None = None) -> dict:
    """Where and with what a benchmark ran, as stored under a report's ``"settings"``.

    Args:
        target: the target model (its dtype and device are recorded), or ``None``.
        command: the command line that produced the report.
        draft_path: the draft's folder, for :func:`draft_revision`.

    Returns:
        ``date``, ``command``, ``cpu``, ``torch_threads``, ``torch_version``, ``transformers_version``,
        ``hf_eagle3_version``, ``code_commit``, ``platform``, and with a target ``target_dtype``, ``device``, ``gpu``; with a local
        draft ``draft_revision``.
    """
    import transformers

    import hf_eagle3

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "cpu": cpu_description(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "hf_eagle3_version": hf_eagle3.__version__,
        "code_commit": code_commit(),
        "platform": platform.platform(),
    }
    if target is not None:
        param = next(target.parameters())
        record.update({"target_dtype": str(param.dtype), "device": str(param.device),
                       "gpu": torch.cuda.get_device_name(param.device) if param.is_cuda else None})
    revision = draft_revision(draft_path)
    if revision is not None:
        record["draft_revision"] = revision
    return record
