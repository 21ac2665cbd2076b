#!/usr/bin/env python3
"""Plots a robustness run's resources.csv (each sidecar's RSS over the run) as a PNG.

usage: scripts/plot-resources.py <report-dir>/resources.csv out.png [title]
Needs matplotlib (pip install matplotlib); the harness itself does not.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    title = sys.argv[3] if len(sys.argv) > 3 else "sidecar RSS"
    series: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    with open(src, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["member"], row["incarnation"])
            xs, ys = series.setdefault(key, ([], []))
            xs.append(float(row["seconds"]) / 60.0)
            ys.append(int(row["rss_kib"]) / 1024.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    colours = {"0": "tab:blue", "1": "tab:orange", "2": "tab:green"}
    labelled = set()
    for (member, _inc), (xs, ys) in sorted(series.items()):
        label = None if member in labelled else f"m{member}"
        labelled.add(member)
        ax.plot(xs, ys, color=colours.get(member, "tab:gray"), linewidth=1, label=label)
    ax.set_xlabel("minutes into the run (a new line: the sidecar restarted)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
