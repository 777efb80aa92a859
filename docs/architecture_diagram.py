"""Draw docs/architecture.svg (the picture in docs/architecture.md) from the tables below.

    python docs/architecture_diagram.py

Plain SVG, no dependencies: edit the boxes and arrows here, run it, commit both files.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

# Process / thread regions: (x, y, w, h, title, fill)
REGIONS = [
    (10, 10, 700, 640, "vLLM scheduler process (EngineCore) — owner thread: vLLM's scheduler",
     "#f3f6fb"),
    (370, 390, 330, 250, "file tier's own threads (never the scheduler's)", "#fdf5e6"),
    (730, 10, 300, 300, "vLLM worker process (one per GPU rank)", "#eef8ee"),
    (730, 330, 300, 150, "/dev/shm (shared by both processes)", "#f5eefa"),
    (730, 500, 300, 150, "filesystem / NVMe", "#f0f0f0"),
    (10, 665, 1020, 85, "operators", "#fafafa"),
]

# Boxes: id -> (x, y, w, h, title, module)
BOXES = {
    "sched": (30, 40, 300, 50, "vLLM Scheduler + OffloadingConnector", "vllm (not ours)"),
    "manager": (30, 120, 300, 50, "TieredManager", "tiering/vllm/manager.py"),
    "chain": (30, 200, 300, 60, "TierChain: routes, one poll()", "tiering/chain.py"),
    "advisor": (370, 200, 320, 60, "PromotionAdvisor: load a disk run?",
                "tiering/advisor.py"),
    "cpu": (30, 300, 300, 60, "CpuTier (RowTier): row records",
            "tiering/cpu_tier.py"),
    "file": (370, 300, 320, 60, "FileTier (StoreTier): SlotTable, policy",
             "backends/file_tier.py"),
    "policies": (30, 400, 300, 50, "policies: lru / arc / s3fifo, StoreThreshold",
                 "policies/*.py"),
    "stats": (30, 480, 300, 50, "TierStats (one per tier), one registry", "tiering/stats.py"),
    "metrics": (30, 570, 300, 50, "vLLM metrics: vllm:kv_tier_*", "tiering/vllm/metrics.py"),
    "committer": (390, 420, 290, 60, "Committer: reserve, write, fsync, publish",
                  "backends/file_io.py"),
    "io": (390, 500, 290, 50, "I/O threads: posix preadv/pwritev, kvikio",
           "backends/slab_io.py, slot_reads.py"),
    "index": (390, 570, 290, 50, "LMDB index (the committer writes it)", "backends/index.py"),
    "worker": (750, 50, 260, 50, "TieredWorker", "tiering/vllm/worker.py"),
    "copy": (750, 130, 260, 60, "copier: CUDA batched DMA / Triton",
             "backends/cuda_copy.py, block_copy.py"),
    "gpu": (750, 220, 260, 60, "GPU KV cache (paged blocks)", "vLLM's tensors"),
    "staging": (750, 370, 260, 60, "staging region: CPU rows", "backends/staging.py"),
    "slabs": (750, 530, 260, 50, "slab-NNNN.dat: fixed-size slots", "backends/slab.py"),
    "lmdb": (750, 590, 260, 45, "index.lmdb/, meta.json", "backends/namespace.py"),
    "cli": (30, 690, 460, 50, "tiering CLI: inspect/stats/verify (read-only), evict/clear",
            "tiering/cli*.py, backends/reader.py, backends/admin.py"),
    "prom": (530, 690, 480, 50, "Prometheus / Grafana", "examples/"),
}

# Arrows: (from, to, label, kind[, shift[, points]]) — kind: call | store | load | data; shift
# moves a straight arrow sideways (px) so the two directions of a path pair do not overlap;
# points draws a bent arrow through them instead (first on from's border, last on to's, the
# label on its second leg). Store path 1-4 red, disk-hit (read) path a-c blue.
EDGES: list[tuple] = [
    ("sched", "manager", "lookup / prepare_store / complete_*", "call"),
    ("manager", "chain", "", "call"),
    ("chain", "cpu", "1 reserve_store", "store", -130),
    ("chain", "cpu", "a lookup, b reserve", "load", -30),
    ("chain", "file", "3 put (demote)", "store", 0, [(290, 260), (290, 274), (440, 274),
                                                     (440, 300)]),
    ("chain", "file", "a lookup, b get", "load", 0, [(310, 260), (310, 287), (480, 287),
                                                     (480, 300)]),
    ("chain", "advisor", "a run pays?", "load"),
    ("cpu", "policies", "", "call"),
    ("stats", "metrics", "", "call"),
    ("file", "committer", "jobs", "store"),
    ("committer", "io", "", "store"),
    ("file", "io", "b reads", "load", 0, [(690, 330), (705, 330), (705, 520), (680, 520)]),
    # b done: the results queue, which FileTier.poll() applies
    ("io", "file", "", "load", 0, [(390, 525), (378, 525), (378, 345), (370, 345)]),
    ("sched", "worker", "transfer specs", "call"),
    ("worker", "copy", "", "call"),
    ("gpu", "copy", "2 store", "data", -40),
    ("copy", "gpu", "c load", "load", 40),
    ("copy", "staging", "2 rows", "data", -100),
    ("staging", "copy", "c rows", "load", 100),
    ("cpu", "staging", "owns rows", "data"),
    ("io", "slabs", "4 write", "data", -10),
    ("slabs", "io", "b read + checksum", "load", 10),
    ("io", "staging", "b into CPU rows", "load"),
    ("index", "lmdb", "", "data"),
    ("metrics", "prom", "/metrics", "call"),
    ("cli", "lmdb", "read-only / admin requests", "call"),
]

COLORS = {"call": "#555555", "store": "#c0392b", "load": "#1f6fb2", "data": "#7d3c98"}


def _anchor(box: tuple, other: tuple) -> tuple[float, float]:
    """The middle of the side of ``box`` that faces ``other``."""
    x, y, w, h = box[:4]
    ox, oy, ow, oh = other[:4]
    cx, cy, ocx, ocy = x + w / 2, y + h / 2, ox + ow / 2, oy + oh / 2
    dx, dy = ocx - cx, ocy - cy
    if abs(dx) * h > abs(dy) * w:
        return (x + w if dx > 0 else x, cy)
    return (cx, y + h if dy > 0 else y)


def _shifted(p: tuple[float, float], q: tuple[float, float], shift: float
             ) -> tuple[tuple[float, float], tuple[float, float]]:
    """The segment p-q moved ``shift`` px along its normal (same side for both directions)."""
    (x1, y1), (x2, y2) = p, q
    if (x1, y1) > (x2, y2):  # one normal per pair of boxes, whichever way the arrow points
        nx, ny = y1 - y2, x2 - x1
    else:
        nx, ny = y2 - y1, x1 - x2
    n = (nx * nx + ny * ny) ** 0.5 or 1.0
    dx, dy = shift * nx / n, shift * ny / n
    return (x1 + dx, y1 + dy), (x2 + dx, y2 + dy)


def render() -> str:
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="1040" height="790" '
           'font-family="Helvetica, Arial, sans-serif" font-size="12">',
           "<defs>"]
    for kind, color in COLORS.items():
        out.append(f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="10" refY="5" '
                   f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                   f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{color}"/></marker>')
    out.append("</defs>")
    out.append('<rect width="1040" height="790" fill="white"/>')
    for x, y, w, h, title, fill in REGIONS:
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" '
                   f'stroke="#999" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x + 8}" y="{y + 16}" font-weight="bold" fill="#444">'
                   f"{escape(title)}</text>")
    for x, y, w, h, title, module in BOXES.values():
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="5" fill="white" '
                   f'stroke="#333"/>')
        out.append(f'<text x="{x + w / 2}" y="{y + h / 2 - 3}" text-anchor="middle" '
                   f'font-weight="bold">{escape(title)}</text>')
        out.append(f'<text x="{x + w / 2}" y="{y + h / 2 + 13}" text-anchor="middle" '
                   f'fill="#666" font-family="monospace" font-size="11">{escape(module)}</text>')
    for a, b, label, kind, *extra in EDGES:
        shift = extra[0] if extra else 0
        via = extra[1] if len(extra) > 1 else []
        color = COLORS[kind]
        dash = ' stroke-dasharray="5 3"' if kind == "data" else ""
        if via:  # a bent arrow through the given points
            points = via
            path = " ".join(f"{x},{y}" for x, y in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       f'stroke-width="1.6"{dash} marker-end="url(#arrow-{kind})"/>')
            (x1, y1), (x2, y2) = points[1], points[2]
        else:
            (x1, y1), (x2, y2) = _shifted(_anchor(BOXES[a], BOXES[b]),
                                          _anchor(BOXES[b], BOXES[a]), shift)
            out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" '
                       f'stroke-width="1.6"{dash} marker-end="url(#arrow-{kind})"/>')
        if label:
            out.append(f'<text x="{(x1 + x2) / 2 + 4}" y="{(y1 + y2) / 2 - 4}" fill="{color}" '
                       f'font-size="11">{escape(label)}</text>')
    legend = [("store path 1-4", "store"), ("disk-hit path a-c", "load"), ("call", "call"),
              ("bytes", "data")]
    for i, (text, kind) in enumerate(legend):
        x = 30 + i * 150
        out.append(f'<line x1="{x}" y1="772" x2="{x + 24}" y2="772" stroke="{COLORS[kind]}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{x + 28}" y="776" font-size="11">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = Path(__file__).with_name("architecture.svg")
    target.write_text(render())
    print(f"wrote {target}")
