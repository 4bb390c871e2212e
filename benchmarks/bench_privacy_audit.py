"""Benchmark: ``ldpsim privacy-audit`` throughput (canary transcripts per second) and the docs table.

Every audited protocol (ToPS is central and not audited), one report with ``--trials-one`` canaries per input
(default 1,000,000: the tightness check of docs/privacy_audit.md) and the three longitudinal games over
``--rounds`` collections (default 31) with ``--trials-long`` canaries per input (default 100,000). A canary
transcript is one canary's whole transcript; the time covers simulating the canaries (world, device sides,
network, collector), decoding their transcripts, scoring them and the Clopper-Pearson bounds. Prints one
JSON record per protocol, writes the rows to ``--out`` (privacy_audit.json/.csv and plots) and appends a
summary record to benchmarks/results.jsonl. The default --out is docs/privacy_audit (with table.md, the
table of docs/privacy_audit.md).

    python benchmarks/bench_privacy_audit.py
    python benchmarks/bench_privacy_audit.py --protocols 1bitmean,thresh --trials-one 100000 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import privacy_audit as pa  # noqa: E402
from scenarios.schema import PROTOCOLS  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocols", default=",".join(p for p in PROTOCOLS if not pa.is_central(p)))
    ap.add_argument("--trials-one", type=int, default=1_000_000)
    ap.add_argument("--trials-long", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT.parent / "docs" / "privacy_audit"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    rows, per_protocol = [], []
    t_all = time.perf_counter()
    for name in args.protocols.split(","):
        table = pa.default_table(name)
        games = pa.games(args.rounds)
        mine = []
        for game in games:
            trials = args.trials_one if game.collections == 1 else args.trials_long
            print(f"{name}: {game.name} ({game.collections} rounds, {trials:,} per input)", file=sys.stderr,
                  flush=True)
            mine.append(pa.audit_game(table, game, trials, args.seed))
        rows += mine
        rec = {"protocol": name, "games": [
            {"game": r.game, "rounds": r.rounds, "trials": r.trials, "claimed": r.as_dict()["claimed"],
             "eps_hat": r.as_dict()["eps_hat"], "eps_lb": r.eps_lb, "statistic": r.statistic,
             "seconds": round(r.seconds, 2), "transcripts_per_second": round(r.transcripts_per_second or 0)}
            for r in mine]}
        print(json.dumps(rec), flush=True)
        per_protocol.append(rec)
    pa.write(rows, Path(args.out))
    (Path(args.out) / "table.md").write_text(pa.markdown_table(rows) + "\n")
    print(pa.format_table(rows))
    record = {
        "benchmark": "privacy_audit", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "trials_one_report": args.trials_one, "trials_longitudinal": args.trials_long, "rounds": args.rounds,
        "seconds": round(time.perf_counter() - t_all, 1),
        "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "exceeds_claim": [f"{r.protocol}/{r.game}" for r in rows if r.exceeds], "protocols": per_protocol,
    }
    if not args.no_record:
        append_result(record)
    return 1 if record["exceeds_claim"] else 0


if __name__ == "__main__":
    sys.exit(main())
