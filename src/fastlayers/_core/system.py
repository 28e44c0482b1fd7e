"""What machine this is, for benchmark reports and run summaries."""

from __future__ import annotations

import platform

_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # the extensions that decide the CPU kernels' speed


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:  # the blank line after the first processor
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_description() -> str:
    """Model name, vendor, family / model and the ISA extensions that decide the kernels, e.g.
    'AMD EPYC (AuthenticAMD, family 25 model 1; avx2)': what a CPU figure names."""
    info = cpuinfo()
    if not info:
        return cpu_name()
    isa = [f for f in _ISA if f in set(info.get("flags", "").split())]
    return (f"{cpu_name()} ({info.get('vendor_id', '?')}, family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}; {', '.join(isa) or 'no AVX2'})")
