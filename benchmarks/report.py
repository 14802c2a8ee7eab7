"""Write an aggregated run out: results.json, the step-time chart, and BENCHMARKS.md (header, tables, details).

Aggregation is in benchmarks/aggregate.py, the tables in benchmarks/tables.py, the text around them in
benchmarks/report_sections.py. The generator owns only the part of the report between its
`<!-- generated:begin ... -->` and `<!-- generated:end -->` lines: a regenerated report keeps everything
outside them (hand-written notes and sections) as it was. Raw data
(results.json) stays in the run's out dir; a report outside that dir (the repository's BENCHMARKS.md) gets
copies of the images it shows in docs/benchmarks/ next to it, so what it links can be committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from benchmarks.aggregate import aggregate, loss_agreement, param_agreement  # noqa: F401 - the CLI's entry points
from benchmarks.config import BRACKET_MODES
from benchmarks.markers import GENERATED_BEGIN, GENERATED_END, merge_markdown
from benchmarks.report_sections import details_section, how_to_run, method_lines, optimizer_text, run_condition_lines
from benchmarks.tables import all_tables


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def plot_step_ms(result: dict[str, Any], path: Path) -> Path:
    """Bar chart of median step ms per mode (min-max whiskers), one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        modes = result["workloads"][name]["modes"]
        labels = list(modes)
        heights = [modes[m].get("step_ms") or 0.0 for m in labels]
        lo = [h - (modes[m].get("step_ms_min") or h) for m, h in zip(labels, heights)]
        hi = [(modes[m].get("step_ms_max") or h) - h for m, h in zip(labels, heights)]
        colors = [
            "#bbbbbb"
            if m in BRACKET_MODES
            else "#888888"
            if m == "eager"
            else "#cc6633"
            if m.startswith("torch")
            else "#3366cc"
            for m in labels
        ]
        bars = ax.bar(range(len(labels)), heights, yerr=[lo, hi], color=colors, capsize=3)
        for i, (m, bar) in enumerate(zip(labels, bars)):
            text = f"{heights[i]:.0f}" if modes[m]["status"] == "ok" else modes[m]["status"]
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel("median step ms (lower is better)")
        ax.set_title(f"{name}: {result['workloads'][name]['description']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


IMAGES_DIR = Path("docs") / "benchmarks"
"""Where a report outside the run's out dir keeps its images, relative to the report."""
_GENERATED_IMAGE = re.compile(r"^(step_ms|timeline_.+)\.png$")


def benchmarks_md(
    result: dict[str, Any],
    *,
    chart: Path | None,
    json_path: Path,
    md_path: Path,
    images: Mapping[str, Path] | None = None,
) -> str:
    """The generated part of BENCHMARKS.md, markers included (`merge_markdown` puts it into the file).

    `images` maps an image the run wrote to the copy the report links instead (`place_images`)."""
    cfg, machine = result["config"], result["machine"]
    rel = lambda p: os.path.relpath(p, md_path.parent)  # noqa: E731 - paths relative to the .md
    img = lambda p: rel((images or {}).get(str(p), p))  # noqa: E731
    claims = cfg["preset"] != "smoke"
    lines = [
        GENERATED_BEGIN,
        "",
        f"Generated {result['generated']} by:",
        "",
        "```",
        result["command"],
        "```",
        "",
        *how_to_run(),
        "## Machine",
        "",
        f"- {machine['cpu']}, {machine['cpu_count']} CPUs ({machine['affinity_cpus']} usable), "
        f"{machine['mem_gib']} GiB RAM; GPUs: {', '.join(machine['gpus']) or 'none'}",
        f"- {machine['platform']}, Python {machine['python']}, torch {machine['torch']}",
        f"- process group: {', '.join(machine['process_group']) or '-'}; {cfg['world_size']} ranks per job, "
        "one thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
        f"- backend `{cfg['backend']}`, {optimizer_text(cfg)} (constant lr), seed {cfg['seed']}; bucket caps "
        "per workload (in each table's title)",
        *run_condition_lines(cfg),
        "",
        *method_lines(cfg),
        "## Results",
        "",
        all_tables(result, timing_claims=claims),
        "",
    ]
    if chart is not None:
        lines += [
            f"Chart: [{img(chart)}]({img(chart)}) · raw data (the run's out dir): `{rel(json_path)}`",
            "",
            f"![step ms per mode]({img(chart)})",
            "",
        ]
    else:
        lines += [f"Raw data: `{rel(json_path)}` (run with --no-plot: no chart)", ""]
    lines += details_section(result, img)
    lines += ["", GENERATED_END]
    return "\n".join(lines) + "\n"


def place_images(result: dict[str, Any], chart: Path | None, *, md_path: Path, out_dir: Path) -> dict[str, Path]:
    """Copy the images the report shows (chart, overlap timelines) to `IMAGES_DIR` next to a report that lies
    outside the run's out dir, removing generated images of earlier runs there; return {image: its copy}.

    A report inside the out dir links the run's own files (returns {}). An image the run did not write
    (a re-render from another machine's results.json) keeps an earlier copy if there is one."""
    if md_path.resolve().is_relative_to(out_dir.resolve()):
        return {}
    dest_dir = md_path.parent / IMAGES_DIR
    sources = [chart] if chart is not None else []
    for data in result["workloads"].values():
        for a in data["modes"].values():
            sources += [
                Path(p)
                for p in ((a.get("overlap") or {}).get("timeline_png"), (a.get("profile") or {}).get("timeline_png"))
                if p
            ]
    placed: dict[str, Path] = {}
    for src in sources:
        dest = dest_dir / src.name
        if src.is_file():
            dest_dir.mkdir(parents=True, exist_ok=True)
            if not dest.exists() or not dest.samefile(src):
                shutil.copyfile(src, dest)
        if dest.is_file():
            placed[str(src)] = dest
    if dest_dir.is_dir():
        for old in dest_dir.iterdir():
            if _GENERATED_IMAGE.match(old.name) and old not in placed.values():
                old.unlink()
    return placed


def write_report(result: dict[str, Any], *, chart: Path | None, json_path: Path, md_path: Path, out_dir: Path) -> Path:
    """Regenerate the report at `md_path`: its images placed (`place_images`), its generated part replaced,
    everything hand-written around it kept (`merge_markdown`)."""
    images = place_images(result, chart, md_path=md_path, out_dir=out_dir)
    generated = benchmarks_md(result, chart=chart, json_path=json_path, md_path=md_path, images=images)
    previous = md_path.read_text() if md_path.is_file() else None
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(merge_markdown(previous, generated, where=str(md_path)))
    return md_path
