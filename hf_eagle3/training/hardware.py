"""Which dtype fits the machine: bfloat16 where the hardware computes it, float32 elsewhere.

Without bf16 hardware a CPU emulates bfloat16 arithmetic, which made ``prepare`` 2.5x slower than float32 on an
AVX2-only EPYC (docs/training.md). ``auto``, the default of ``prepare --dtype``, ``train --feature-dtype`` and
``train --mixed-precision``, resolves through :func:`resolve_dtype`.
"""

from __future__ import annotations

from ..environment import cpu_flags

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_hardware(device: str = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and why (the reason is printed with the choice).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...

    Returns:
        ``(has_bf16, reason)``.
    """
    import torch

    kind = str(device).split(":")[0]
    if kind == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "GPU with bf16"
        return False, "no bf16 hardware: this GPU lacks bf16"
    if kind != "cpu":
        return False, f"no bf16 check for device {device!r}"
    flags = cpu_flags()
    if flags is None:
        return False, "no bf16 hardware known: /proc/cpuinfo unreadable"
    found = [f for f in BF16_CPU_FLAGS if f in flags]
    if found:
        return True, f"CPU flags have {'/'.join(found)}"
    return False, f"no bf16 hardware: CPU flags lack {'/'.join(BF16_CPU_FLAGS)}"


def resolve_dtype(value: str, device: str = "cpu", *, label: str = "dtype", bf16: str = "bfloat16",
                  fallback: str = "float32") -> tuple[str, str]:
    """Resolve ``"auto"`` to ``bf16`` on bf16 hardware and to ``fallback`` elsewhere; an explicit value wins.

    Args:
        value: ``"auto"`` or an explicit choice (returned as is).
        device: where the computation runs (see :func:`bf16_hardware`).
        label: what the value is, for the returned line (``"dtype"``, ``"mixed precision"``, ...).
        bf16: the choice on bf16 hardware (``"bfloat16"``; ``"bf16"`` for mixed precision).
        fallback: the choice elsewhere (``"float32"``; ``"no"`` for mixed precision).

    Returns:
        ``(choice, line)``, e.g. ``("float32", "dtype: auto -> float32 (no bf16 hardware: CPU flags lack
        avx512_bf16/amx_bf16)")``.
    """
    if value != "auto":
        return value, f"{label}: {value} (as given)"
    has, reason = bf16_hardware(device)
    choice = bf16 if has else fallback
    return choice, f"{label}: auto -> {choice} ({reason})"
