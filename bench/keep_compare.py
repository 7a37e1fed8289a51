"""Keep a ``loadtest compare`` run in bench/results: its compare.md, and its compare.json
without the per-request records (the summaries, the setup, the bounds, the replicas'
prefill, the restart windows stay).

    .venv/bin/python -m bench.keep_compare NAME artifacts/compare-NAME
        -> bench/results/compare_NAME.md, bench/results/compare_NAME.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadtest import compare

RESULTS = Path(__file__).resolve().parent / "results"


def keep(name: str, src: Path) -> tuple[Path, Path]:
    """The rows and the table are made again from the runs by today's ``loadtest.compare``
    (its summaries may have grown since the run)."""
    doc = json.loads((src / "compare.json").read_text())
    for run in doc["runs"].values():
        run.pop("records", None)
    runs = doc["runs"]
    rr = next((runs[n] for n in runs if n.split(" x")[0] == "round_robin"), None)
    doc["rows"] = [compare.summary_row(n, run, rr) for n, run in runs.items()]
    setup_text = (src / "compare.md").read_text().split("\n", 1)[0]
    out_json, out_md = RESULTS / f"compare_{name}.json", RESULTS / f"compare_{name}.md"
    out_json.write_text(json.dumps(doc, indent=1) + "\n")
    out_md.write_text(compare.markdown(doc["rows"], doc["bounds"], setup_text))
    return out_json, out_md


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in keep(args[0], Path(args[1])):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
