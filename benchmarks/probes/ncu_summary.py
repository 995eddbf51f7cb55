"""A short table of an Nsight Compute raw CSV (``ncu --import R.ncu-rep --csv --page raw``), one row a kernel.

    python3 benchmarks/probes/ncu_summary.py ncu-kimi-k2.7-raw.csv

Columns: the kernel, its time, DRAM bytes read and written and their rate, the L2 hit rate and bytes, and
the speed-of-light and tensor-pipe percentages ncu reports (whichever of them the report holds). Works on
any machine (no GPU, no ncu): it only reads the CSV.
"""

from __future__ import annotations

import argparse
import csv

# (header, metric names to try in order, scale, format)
COLUMNS = (
    ("ms", ("gpu__time_duration.sum",), 1e-6, "{:.3f}"),  # ns in the raw page
    ("DRAM rd GB", ("dram__bytes_read.sum",), 1e-9, "{:.2f}"),
    ("DRAM wr GB", ("dram__bytes_write.sum",), 1e-9, "{:.2f}"),
    ("L2 GB", ("lts__t_bytes.sum",), 1e-9, "{:.1f}"),
    ("L2 hit %", ("lts__t_sector_hit_rate.pct",), 1, "{:.1f}"),
    ("DRAM %peak", ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                    "dram__throughput.avg.pct_of_peak_sustained_elapsed"), 1, "{:.1f}"),
    ("L2 %peak", ("lts__throughput.avg.pct_of_peak_sustained_elapsed",), 1, "{:.1f}"),
    ("SM %peak", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), 1, "{:.1f}"),
    # the tensor pipe's busy cycles over the kernel's time (sm__inst_executed_pipe_tensor_op_gmma counts
    # instructions, ~4% for a kernel whose tensor pipe is 70% busy: not this column)
    ("tensor %", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",), 1, "{:.1f}"),
)
UNIT_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6,
              "second": 1e9}


def short(name: str, n: int = 44) -> str:
    name = name.split("(")[0].replace("void ", "")
    return name if len(name) <= n else name[: n - 3] + "..."


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--grep", default="", help="extra metric-name substring to list per kernel")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)  # ncu may print ==PROF== lines first
    names, units, data = rows[head], rows[head + 1], rows[head + 2:]
    col = {n: i for i, n in enumerate(names)}
    kname = col["Kernel Name"]

    def value(r, metric, scale):
        i = col.get(metric)
        if i is None or i >= len(r) or r[i] in ("", "n/a"):
            return None
        v = float(r[i].replace(",", ""))
        return v * UNIT_SCALE.get(units[i], 1) * scale

    present = []
    for label, metrics, scale, fmt in COLUMNS:
        m = next((m for m in metrics if m in col), None)
        if m is not None:
            present.append((label, m, scale, fmt))
    print(f"{'kernel':<46}" + "".join(f"{p[0]:>12}" for p in present))
    for r in data:
        cells = []
        for _, m, scale, fmt in present:
            v = value(r, m, scale)
            cells.append("-" if v is None else fmt.format(v))
        print(f"{short(r[kname]):<46}" + "".join(f"{c:>12}" for c in cells))
        if args.grep:
            for n, i in col.items():
                if args.grep in n and i < len(r):
                    print(f"    {n} = {r[i]} {units[i]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
