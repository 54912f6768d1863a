"""The default benchmark's output (`benchmarks/bench.py`): a result as a Markdown table, the machine it ran on, and
an optional plot (matplotlib, when installed). Not part of the node pack."""
from __future__ import annotations

import os
import platform
import textwrap

import torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version(), device=device.type)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = _cpu_name()
        info["cores"] = os.cpu_count()
        info["threads"] = torch.get_num_threads()
    return info


def format_table(result: dict, device: torch.device) -> str:
    scaled = result["tokens"] != result["full_tokens"]
    head = result["case"]
    if result.get("label"):
        head = f"{result['label']}, {head}"
    if not head.endswith(" tokens") or scaled:
        head += f": {result['tokens']:,} tokens run"
    if scaled:
        head += f" (stands for {result['full_tokens']:,})"
    head += f", |x| = {result['unit_bytes'] / 2**20:,.1f} MiB"
    cpu = device.type == "cpu"
    lines = [head, "",
             "| method | head groups | peak GiB | peak x|x| | time ms |" + (" CPU time ms |" if cpu else "")
             + " max abs diff vs stock | relative |",
             "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if cpu else "") + " ---: | ---: |"]
    for row in result["rows"]:
        cpu_time = f" {row['cpu_time_s'] * 1e3:,.0f} |" if cpu else ""
        lines.append(f"| {row['method']} | {row['groups'] or '-'} | {row['peak_gib']:.4f} | {row['peak_x']:.2f} | "
                     f"{row['time_s'] * 1e3:,.0f} |{cpu_time} {row['max_abs_diff']:.3g} | {row['rel_diff']:.2g} |")
    if result.get("parts"):
        reference = result["rows"][0]["method"]
        lines += ["", f"{reference}, parts alone (peak above the part's input, its result included): " + ", ".join(
            f"{p['part']} {p['peak_gib']:.4f} GiB = {p['peak_x']:.2f} x|x|" for p in result["parts"])]
    return "\n".join(lines)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: python3 -m pip install matplotlib "
                         "(scripts/bench --plot FILE installs it)") from None
    return plt


def plot(results: list, path: str, title: str) -> None:
    plt = pyplot()
    methods = [row["method"] for row in results[0]["rows"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    width = 0.8 / max(1, len(results))
    for ax, key, label in ((axes[0], "peak_x", "peak working set, x |x| (lower is better)"),
                           (axes[1], "time_s", "time, ms (lower is better)")):
        for index, result in enumerate(results):
            values = [row[key] * (1e3 if key == "time_s" else 1) for row in result["rows"]]
            positions = [m + (index - (len(results) - 1) / 2) * width for m in range(len(methods))]
            bars = ax.bar(positions, values, width, label=result["case"] if result["case"].endswith(" tokens")
                          else f"{result['case']} ({result['tokens']:,} tokens)")
            ax.bar_label(bars, fmt="%.2f" if key == "peak_x" else "%.0f", fontsize=7)
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.25)   # room for the bar labels and the legend above the tallest bars
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


__all__ = ["machine_info", "format_table", "plot", "pyplot"]
