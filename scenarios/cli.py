"""The command line: ``ldpsim run SCENARIO [--out DIR] [--set KEY=VALUE ...]`` and
``ldpsim sweep SCENARIO --grid KEY=V1,V2,... --repeat R --out DIR`` (see scenarios/sweep.py).

Errors in the scenario or the arguments print one line naming what is wrong and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agents.behavior import BehaviorError
from protocols.base import DefinitionError
from protocols.guard import BudgetOverrun
from scenarios import allocator, failure, jit, jsonout, resources
from scenarios.schema import ScenarioError, load
from scenarios.extras import install_command


#: every file a run directory may hold (``ldpsim run``/``live``/``serve`` and ``ldpsim audit``'s report):
#: before a run writes there these (and only these names) are removed; a user's own files stay
RUN_FILES = ("summary.json", "scenario.json", "events.jsonl", "downlink.jsonl", "estimates.csv", "estimates.png",
             "ledger.csv", "ledger.parquet", "spend.csv", "spend.parquet", "spend.png", "spend_over_time.csv",
             "transcript.parquet", "eps_delta.csv", "attacks.csv", "attacks.png", "audit.json")


def clear_previous_run(out: Path) -> None:
    """Remove every file of a previous run in ``out`` (summary.json first: the old run stops being complete),
    so no table of the old run can sit beside the new summary, with the temporary files a killed run left
    (``.STEM.tmp-PID.SUFFIX``, ``NAME.tmp``). Other files are left alone: a user's own ``notes.csv`` beside the run stays."""
    (out / "summary.json").unlink(missing_ok=True)
    for name in RUN_FILES:
        path = out / name
        stem, suffix = path.stem, path.suffix
        for found in (path, path.with_name(name + ".tmp"), *out.glob(f".{stem}.tmp-*{suffix}")):
            if found.is_file():
                found.unlink()


def discard_partial_run(out: Path, remove_dir: bool) -> None:
    """What a failed run wrote in ``out`` (its run files), and ``out`` itself where it is then empty and
    ``remove_dir`` (the run made it): nothing half-written stays behind."""
    clear_previous_run(out)
    if remove_dir and not any(out.iterdir()):
        out.rmdir()


def _within_pattern(privacy: dict) -> str:
    """For memoized protocols, what kind of number the guarantee is, and the worst-case loss beside it."""
    worst = privacy.get("worst_case_loss")
    if not isinstance(worst, dict):
        return ""
    value = _num(worst.get("value")) if worst.get("bounded") else "unbounded"
    return f" within a behavior pattern; worst-case loss {value}"


def _num(x: float | None) -> str:
    """A figure for the one-line report; n/a where it is unknown (e.g. no round had an estimate)."""
    return "n/a" if x is None else f"{x:.4g}"


def _progress_bar(total: int, enabled: bool, desc: str = "simulating", unit: str = "round"):
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(done: int, of: int) -> None:
        bar.total = of  # a live run counts collections (THRESH: epochs), not rounds
        bar.update(done - bar.n)

    return update, bar.close


#: devices x rounds from which ``ldpsim run`` draws the run directory's pictures in a process of its own, started
#: when the run begins (scenarios/plot_process.py): it imports matplotlib while this process imports and
#: simulates (at the lowest priority: only on cores the run leaves idle) and draws while this process writes
#: the tables
PLOT_PROCESS = 10_000_000
#: devices x rounds from which ``ldpsim run`` says, after the progress bar, that it is writing the run directory
#: (300,000 x 31 with attack metrics: about 5 s)
WRITING_LINE = 5_000_000


def cmd_run(args: argparse.Namespace) -> int:
    scenario = load(args.scenario, args.set)
    if args.engine == "local":  # on Ray the devices live in the cluster's actors
        workers = scenario.simulation.workers
        resources.check_memory(scenario.devices, workers + 1 if workers > 1 else 1)
    for warning in scenario.warnings:
        print(f"ldpsim: warning: {warning}", file=sys.stderr)
    engine = None
    if args.engine == "ray":  # device shards as Ray actors (scenarios/ray_engine.py); a missing extra: exit 2
        from scenarios import ray_engine

        engine = ray_engine.engine(address=args.ray_address, shards=scenario.simulation.workers)
    elif args.ray_address:
        raise ScenarioError("--ray-address: only with --engine ray")
    if args.out is None:
        out = Path("runs") / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    elif not args.out.strip():
        raise ScenarioError("--out: empty path (give the run directory)")
    else:
        out = Path(args.out)
    if (out / "summary.json").exists() and not args.force:
        raise ScenarioError(f"--out {out}: holds a finished run; pass --force to overwrite it or choose another")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot create the run directory: {exc.strerror or exc}") from None
    clear_previous_run(out)
    painter = None
    if scenario.devices * scenario.rounds >= PLOT_PROCESS:  # first: it imports while this process does
        from scenarios import plot_process

        painter = plot_process.start()
    try:
        from scenarios import output, runner  # heavy imports after the arguments are known to be good

        print(f"ldpsim: {scenario.name}: {scenario.devices:,} devices x {scenario.rounds} rounds, "
              f"{scenario.protocol.name} (eps = {scenario.protocol.epsilon:g}) -> {out}", file=sys.stderr)
        update, close = _progress_bar(scenario.rounds, not args.quiet)
        with open(out / "events.jsonl", "w", encoding="utf-8") as events:
            result = runner.run(scenario, events=events, progress=update, engine=engine)
        close()
        if not args.quiet and scenario.devices * scenario.rounds >= WRITING_LINE:  # seconds, not a silent pause
            print(f"ldpsim: writing {out}: tables, pictures, summary"
                  f"{' and attack metrics' if scenario.attacks else ''}", file=sys.stderr)
        summary = output.write_run_dir(result, out, ledger_rows=not args.no_ledger_rows, transcript=args.transcript,
                                       painter=painter)
    except BaseException:  # a run that failed (a behavior's error, an interrupt) leaves no partial run behind
        if painter is not None:  # its pictures drawn (or abandoned) first: none lands after the clearing
            painter.close()
            painter = None
        discard_partial_run(out, created)
        raise
    finally:
        if painter is not None:
            painter.close()
    from scenarios import metrics

    err, eps, pv = summary["error"], summary["epsilon"], summary["privacy"]
    print(f"mean |error| {_num(err['mean_abs'])}, max |error| {_num(err['max_abs'])} "
          f"({metrics.error_of(scenario.protocol, scenario.unit)}{_missing_rounds(err, scenario)}); "
          f"per-device spend (epsilon): "
          f"max {_num(eps['max'])}, mean {_num(eps['mean'])}, p99 {_num(eps['p99'])} "
          f"(guarantee {_num(pv['guarantee'])}{_within_pattern(pv)}{_budget(pv)}); messages rejected "
          f"{summary['messages']['rejected']}; "
          f"simulated in {summary['wall_seconds']:.2f} s{_engine_note(summary.get('parallelism'))}",
          file=sys.stderr if args.json else sys.stdout)
    if args.json:  # stdout holds summary.json alone, for a pipe into a JSON reader
        print(jsonout.dumps(summary, indent=2))
    return max(_own_rejections(summary), _privacy_verdict(pv))


def _engine_note(parallelism: dict | None) -> str:
    """What the one-line report adds about another engine's shards: the seconds of the simulation spent
    starting them (Ray's start-up), and shards restarted and rebuilt on the way."""
    if not parallelism:
        return ""
    notes = []
    if parallelism.get("start_seconds") is not None:
        engine = parallelism.get("engine")
        what = "starting or joining Ray" if engine == "ray actors" else f"starting the {engine or 'shards'}"
        notes.append(f"{parallelism['start_seconds']:.2f} s of it {what}")
    if parallelism.get("restarts"):
        notes.append(f"{parallelism['restarts']} shard restart(s) recovered by replay")
    return f" ({'; '.join(notes)})" if notes else ""


def _own_rejections(summary: dict) -> int:
    """1, with a line on stderr, when the collector rejected batches other than late ones in a run whose devices
    are all the protocol's own (``run``, ``live``): its device and collector sides disagree (a plugin's column of
    another dtype than the collector declares, say), and those reports were lost while their devices were
    charged; else 0."""
    msgs = summary["messages"]
    dropped = sum((summary.get("live") or {}).get("dropped", {}).values())  # connections, counted as rejected
    own = int(msgs["rejected"]) - int(msgs["late"]) - int(dropped)
    if own <= 0 or msgs.get("first_rejection") is None:
        return 0
    print(f"ldpsim: error: the collector rejected {own:,} of its own devices' messages (not counting late ones): "
          f"the protocol's device and collector sides disagree, and those reports are lost while their devices "
          f"were charged; the first: {msgs.get('first_rejection')} (events.jsonl: message_rejected; the run "
          f"directory is kept)", file=sys.stderr)
    return 1


def _budget(pv: dict) -> str:
    """``; budget B, N reports refused`` for a run whose devices enforced a budget; else nothing."""
    if pv.get("budget") is None:
        return ""
    refused = pv.get("refusals")
    return f"; budget {_num(pv['budget'])}" + ("" if refused is None else f", {refused:,} reports refused for it")


def _missing_rounds(err: dict, scenario: Any) -> str:
    """The note '; N rounds without an estimate, left out' when the error figures leave some rounds out (epochs
    for THRESH); else nothing."""
    missing = int(err.get("rounds_without_estimate") or 0)
    unit = "epoch" if scenario.protocol.kind == "epoch" else "round"
    return f"; {missing} {unit}{'s' if missing != 1 else ''} without an estimate, left out" if missing else ""


def _privacy_verdict(pv: dict) -> int:
    """1, with a line on stderr, when a device spent past the protocol's own guarantee or the budget (a
    protocol whose guarantee is wrong: its devices charged more than it claims); else 0."""
    broken = [what for what, ok in (("its guarantee", pv.get("within_guarantee")),
                                     ("the budget", pv.get("within_budget"))) if ok is False]
    if not broken:
        return 0
    budget = "" if pv.get("budget") is None else f", budget {_num(pv['budget'])}"
    print(f"ldpsim: error: privacy: a device spent {_num(pv.get('max_spend'))}, past {' and '.join(broken)} "
          f"(guarantee {_num(pv.get('guarantee'))}{budget}): the protocol charges more than it claims; the run "
          f"directory is kept for `ldpsim audit`", file=sys.stderr)
    return 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from scenarios import sweep as sweeps  # heavy imports only for this command

    cluster = None
    if args.cluster is not None:
        cluster = sweeps.parse_cluster(args.cluster)
        if args.workers is not None:
            raise ScenarioError("--workers: not used with --cluster (local:N sets the number of workers)")
        sweeps.import_distributed()
    sw = sweeps.plan(args.scenario, args.grid, args.repeat, args.workers, args.set)
    parallel = 1 if cluster is not None else max(1, min(sw.workers, len(sw.points) * sw.repeat))
    resources.check_memory(sw.largest_devices * parallel, parallel + 1, "--workers")  # runs at once, each the largest
    for warning in sw.warnings:
        print(f"ldpsim: warning: {warning}", file=sys.stderr)
    out = Path(args.out)
    try:
        outcome = sweeps.execute(sw, out, force=args.force, quiet=args.quiet, cluster=cluster)
    except KeyboardInterrupt as exc:  # the finished runs are in runs.jsonl: say so, and that the same command resumes
        try:
            kept = f"{len(sweeps.load_records(sw, out))} of {len(sw.points) * sw.repeat} run(s) are kept"
        except (OSError, ValueError, ScenarioError):
            kept = "the finished runs are kept"
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"ldpsim: {how}: {kept} in {out / 'runs.jsonl'}; the same command resumes with the rest",
              file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    print(f"ldpsim: sweep {sw.name}: {outcome.finished} run(s) finished now, {outcome.skipped} already done, "
          f"{outcome.failed} failed, of {outcome.total}; {out / 'results.csv'}, {out / 'points.csv'}, "
          f"{out / 'results.parquet'} and {len(outcome.plots)} plot(s)", file=sys.stderr)
    code = 0
    if outcome.breached:
        print(f"ldpsim: error: privacy: {len(outcome.breached)} run(s) where a device spent past the protocol's own "
              f"guarantee or the budget (results.csv within_guarantee): {outcome.breached[0]}"
              f"{f' (and {len(outcome.breached) - 1} more)' if len(outcome.breached) > 1 else ''}", file=sys.stderr)
        code = 1
    if outcome.failed:
        print(f"ldpsim: {outcome.failed} run(s) failed: see {out / 'failed.jsonl'}; "
              "repeat the command to retry them", file=sys.stderr)
        code = 1
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    from scenarios import compare

    scenario = load(args.scenario, args.set)
    resources.check_memory(scenario.devices)
    out = Path(args.out) if args.out else Path("runs") / f"{scenario.name}-compare-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / "compare.json").exists() and not args.force:
        raise ScenarioError(f"--out {out}: holds a finished comparison; pass --force to overwrite it or choose "
                            "another")
    table = compare.compare(scenario, out, lambda label, rounds: _progress_bar(rounds, not args.quiet,
                                                                               f"simulating {label}"))
    for k in (scenario.protocol.name, "naive"):
        e, eps = table[k]["error"], table[k]["epsilon"]
        per_item = f", mean max item error {_num(e['hist_max_abs'])}" if "hist_max_abs" in e else ""  # HeavyTHRESH
        print(f"{k:>6}: mean |error| {_num(e['mean_abs'])}, max |error| {_num(e['max_abs'])}{per_item}; "
              f"per-device spend max {_num(eps['max'])}, mean {_num(eps['mean'])}")
    print(f"written to {out}/compare.csv, compare.json, compare.png")
    return 0


def _live_out(args: argparse.Namespace, name: str, suffix: str) -> Path:
    out = Path(args.out) if args.out else Path("runs") / f"{name}-{suffix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / "summary.json").exists() and not args.force:
        raise ScenarioError(f"--out {out}: holds a finished run; pass --force to overwrite it or choose another")
    out.mkdir(parents=True, exist_ok=True)
    clear_previous_run(out)
    return out


def _secret(args: argparse.Namespace) -> bytes | None:
    from protocols.auth import SecretError, read_secret

    if not args.secret_file:
        return None
    try:
        return read_secret(args.secret_file)
    except SecretError as exc:
        raise ScenarioError(f"--secret-file {exc}") from None


def auth_key_id(secret: bytes) -> str:
    """The secret's key id (protocols.auth.key_id), imported when a live command needs it."""
    from protocols.auth import key_id

    return key_id(secret)


def credentials_name(index: int | str, count: int) -> str:
    """The file ``ldpsim credentials`` writes for shard ``index`` (1-based) of ``count``."""
    return f"credentials-shard-{index}-of-{count}.bin"


def _span(first: int, count: int) -> str:
    return f"{first:,}-{first + count - 1:,}"


def _shard_credentials(args: argparse.Namespace):
    """``--credentials FILE``: the shard's devices' credentials (protocols.auth.Credentials), or None."""
    from protocols.auth import CredentialsError, read_credentials

    if getattr(args, "credentials", None) is None:
        return None
    if not args.credentials:
        raise ScenarioError("--credentials '': expected the path of this shard's credentials file")
    if args.secret_file:
        raise ScenarioError("--credentials and --secret-file: give one (a shard needs only its credentials)")
    try:
        return read_credentials(args.credentials)
    except CredentialsError as exc:
        raise ScenarioError(f"--credentials {exc}") from None


def cmd_credentials(args: argparse.Namespace) -> int:
    """Write each shard's device credentials to a file of its own (protocols/auth.py): the operator keeps the
    deployment secret, and each ``ldpsim devices`` process gets only its shard's file (``--credentials``)."""
    import tempfile

    from protocols.auth import pack_credentials
    from scenarios.live import shard_first, shard_size

    scenario = load(args.scenario, args.set)
    secret = _secret(args)
    if secret is None:
        raise ScenarioError("--secret-file: required (the deployment secret the collector serves with)")
    count = _int_arg("--shards", args.shards)
    if not 1 <= count <= scenario.devices:
        raise ScenarioError(f"--shards {args.shards}: expected 1 to {scenario.devices:,} (the devices)")
    if not args.out:
        raise ScenarioError("--out '': expected a directory for the credentials files")
    out = Path(args.out)
    if out.is_symlink() and not out.exists():
        raise ScenarioError(f"--out {out}: is a symbolic link to nothing")
    if out.exists() and not out.is_dir():
        raise ScenarioError(f"--out {out}: is a file, expected a directory")
    names = [credentials_name(i, count) for i in range(1, count + 1)]
    there = [n for n in names if os.path.lexists(out / n)]
    if there and not args.force:
        more = f" and {len(there) - 1:,} more" if len(there) > 1 else ""
        raise ScenarioError(f"--out {out}: already holds {there[0]}{more}; pass --force to overwrite")
    update, close = _progress_bar(count, not args.quiet and scenario.devices >= 1_000_000, "credentials", "file")
    written: list[str] = []  # temporary files, each created new (O_EXCL, mode 0600) under a random name
    try:
        out.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            first, held = shard_first(scenario.devices, i, count), shard_size(scenario.devices, i, count)
            fd, tmp = tempfile.mkstemp(prefix=".credentials-", suffix=".tmp", dir=out)
            written.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(pack_credentials(secret, first, held))
            if update is not None:
                update(i + 1, count)
        for tmp, name in zip(written, names):  # all written: moved into place together (a rename replaces a
            os.replace(tmp, out / name)  # link there, never writes through it)
        written = []
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot write the credentials files: "
                            f"{exc.strerror or exc}") from None
    finally:
        close()
        for tmp in written:  # failed or interrupted: no file of this run is left, and the old ones are kept
            if os.path.lexists(tmp):
                os.unlink(tmp)
    print(f"ldpsim: credentials of {scenario.devices:,} devices in {count:,} file(s) -> {out} (key id "
          f"{auth_key_id(secret)}); give shard I only its own: ldpsim devices {shlex.quote(args.scenario)} ... "
          f"--shard I/{count} --credentials {out / credentials_name('I', count)}")
    return 0


def _tls(what: str, make, *paths: str):
    import ssl

    try:
        return make(*paths)
    except (OSError, ssl.SSLError) as exc:
        raise ScenarioError(f"{what}: cannot load {' / '.join(paths)}: {exc}") from None


def _client_tls(args: argparse.Namespace):
    """The device side's TLS context: --tls-ca (in `live`, the server's own --tls-cert if no --tls-ca)."""
    from scenarios import live

    ca = args.tls_ca or getattr(args, "tls_cert", None)
    return _tls("--tls-ca", live.client_tls, ca) if ca else None


def _settings(args: argparse.Namespace):
    from collector.server import LiveSettings
    from scenarios import live

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ScenarioError("--tls-cert and --tls-key go together")
    tls = _tls("--tls-cert/--tls-key", live.server_tls, args.tls_cert, args.tls_key) if args.tls_cert else None
    return LiveSettings(stage_timeout=args.stage_timeout, read_timeout=args.read_timeout,
                        hello_timeout=args.hello_timeout, write_timeout=args.write_timeout,
                        max_connections=args.max_connections, max_pending_per_host=args.max_pending_per_host,
                        secret=_secret(args), tls=tls,
                        round_pause=getattr(args, "round_pause", 0.0), startup_timeout=args.startup_timeout)


def _print_drops(result) -> None:
    dropped = result.extra.get("live", {}).get("dropped")
    if dropped:
        print("ldpsim: connections dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()), file=sys.stderr)


def _network_note(scenario) -> None:
    """Say which of the scenario's simulated network settings a live run leaves out (live.ignored_network)."""
    from scenarios import live

    ignored = live.ignored_network(scenario)
    if ignored:
        items = ", ".join(f"{k} {v:g}" for k, v in ignored.items())
        print(f"ldpsim: note: a live run over real TCP does not simulate the scenario's network {items} "
              "(summary.json live.network_not_applied)", file=sys.stderr)


def cmd_live(args: argparse.Namespace) -> int:
    """Server and device clients in one process over loopback TCP."""
    import asyncio

    from scenarios import live, output

    scenario = load(args.scenario, args.set)
    resources.check_memory(scenario.devices)
    args.connections = _connections(args.connections, scenario.devices, 2)  # both ends of each are in this process
    settings, client_tls = _settings(args), _client_tls(args)  # a bad secret or certificate: before any file
    created = not (args.out and Path(args.out).exists())
    out = _live_out(args, scenario.name, "live")
    _network_note(scenario)
    update, close = _progress_bar(scenario.rounds, not args.quiet, "live rounds")
    try:
        try:
            with open(out / "events.jsonl", "w", encoding="utf-8") as events:
                result = asyncio.run(live.run_embedded(scenario, args.connections, events, settings,
                                                       client_tls=client_tls, progress=update))
        finally:
            close()
        _print_drops(result)
        summary = output.write_run_dir(result, out, ledger_rows=not args.no_ledger_rows)
    except BaseException:  # a run that failed (a plugin's error, an interrupt) leaves no partial run behind
        discard_partial_run(out, created)
        raise
    err, pv = summary["error"], summary["privacy"]
    print(f"live run over {args.connections} connection(s): mean |error| {_num(err['mean_abs'])}, max |error| "
          f"{_num(err['max_abs'])}; per-device spend (epsilon): max {_num(pv.get('max_spend'))} (guarantee "
          f"{_num(pv['guarantee'])}{_within_pattern(pv)}{_budget(pv)}); transcript digest "
          f"{summary['digests']['transcript'][:12]}...; run in {summary['wall_seconds']:.2f} s -> {out}")
    return max(_own_rejections(summary), _privacy_verdict(summary["privacy"]))


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from scenarios import live, output

    from scenarios import journal

    scenario = load(args.scenario, args.set)
    resources.check_memory(scenario.devices)
    settings = _settings(args)
    out = _resume_dir(args) if args.resume else _live_out(args, scenario.name, "serve")
    bar: list = [None, lambda: None]  # (update, close): the progress bar, started with the rounds

    def listening(port: int) -> None:
        sets = "".join(f" --set {shlex.quote(kv)}" for kv in args.set)  # the devices must run the same scenario
        creds = (f" --credentials FILE; devices authenticated under key id {auth_key_id(settings.secret)}, each "
                 "shard's FILE from ldpsim credentials" if settings.secret else "")
        print(f"ldpsim: serving {scenario.name} on {args.host}:{port}; waiting up to "
              f"{settings.startup_timeout:g} s for {scenario.devices:,} devices (ldpsim devices "
              f"{shlex.quote(args.scenario)}{sets} --connect HOST:{port} --shard I/N{creds})", file=sys.stderr,
              flush=True)
        _network_note(scenario)

    def progress(done: int, of: int) -> None:
        if bar[0] is not None:
            bar[0](done, of)

    def started(held: int, devices: int) -> None:
        if held < devices:
            print(f"ldpsim: warning: {held:,} of {devices:,} devices connected within {settings.startup_timeout:g} s;"
                  f" the rounds run without the other {devices - held:,} (their reports are missing from every "
                  "estimate; summary.json live.devices_at_start; --startup-timeout waits longer)",
                  file=sys.stderr, flush=True)
        bar[:] = _progress_bar(scenario.rounds, not args.quiet, "live rounds")  # below the lines above

    try:
        with open(out / "events.jsonl", "a" if args.resume else "w", encoding="utf-8") as events:
            result = asyncio.run(live.serve(scenario, args.host, args.port, events, settings, out, bool(args.resume),
                                            listening=listening, progress=progress, started=started))
    except ScenarioError:  # the port in use, no device came: a new run directory that holds no round is not
        # left behind (its journal, if any, is of round 0)
        if not args.resume and _no_round_run(out, scenario):
            journal.finish(out)
            discard_partial_run(out, not args.out)
        raise
    finally:
        bar[1]()
    _print_drops(result)
    summary = output.write_run_dir(result, out, ledger_rows=False)
    journal.finish(out)  # the run directory is complete: the journal is no longer needed
    held = (summary.get("live") or {}).get("devices_at_start")
    short = f" with {held:,} of {scenario.devices:,} devices" if held is not None and held < scenario.devices else ""
    empty = sum(1 for r in result.rounds if not r.reports)
    if empty:  # e.g. devices that answered after every stage timeout: the collector learned nothing those rounds
        print(f"ldpsim: warning: {empty} of {len(result.rounds)} rounds closed without a report (see events.jsonl "
              f"stage_timeout and message_rejected)", file=sys.stderr)
    print(f"served {len(result.rounds)} rounds{short}: mean |error| {_num(summary['error']['mean_abs'])} -> {out}")
    return 0


def _no_round_run(out: Path, scenario) -> bool:
    """Whether ``serve``'s run directory holds only an event log and a journal of no round closed or open."""
    from scenarios import journal

    if not {f.name for f in out.iterdir()} <= {"events.jsonl", journal.JOURNAL, journal.RECORDS}:
        return False
    try:
        state = journal.check(out, scenario)
    except journal.JournalError:  # no journal (the bind failed) or one this run cannot read: only the log is new
        return not (out / journal.JOURNAL).exists()
    return state["last_round"] == 0 and state["open"] is None


def _resume_dir(args: argparse.Namespace) -> Path:
    """``serve --resume DIR``: the run directory of the collector that stopped (its journal is there)."""
    from scenarios import journal

    out = Path(args.resume)
    if args.out and Path(args.out).resolve() != out.resolve():
        raise ScenarioError(f"--resume {out} continues the run in that directory: leave out --out {args.out}")
    if (out / "summary.json").exists():
        raise ScenarioError(f"--resume {out}: holds a finished run (summary.json); nothing to resume")
    if not (out / journal.JOURNAL).is_file():
        raise ScenarioError(f"--resume {out}: no {journal.JOURNAL} there (not a run directory of ldpsim serve, "
                            "or a finished run)")
    journal.check(out, load(args.scenario, args.set))  # a corrupt journal or another scenario: one line, now
    return out


def cmd_devices(args: argparse.Namespace) -> int:
    import asyncio

    from scenarios import live, output

    scenario = load(args.scenario, args.set)
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdecimal() or not 1 <= int(port) <= 65535:
        raise ScenarioError(f"--connect {args.connect!r}: expected HOST:PORT with a port 1-65535")
    index, _, count = args.shard.partition("/")
    if not (index.isdecimal() and count.isdecimal() and 1 <= int(index) <= int(count)):
        raise ScenarioError(f"--shard {args.shard!r}: expected I/N with 1 <= I <= N")
    if args.resume and not args.out:
        raise ScenarioError("--resume: the saved device state is in --out DIR; give it")
    from agents.client import GIVE_UP_AFTER
    from scenarios import journal
    from scenarios.live import shard_first, shard_size

    if args.out:
        journal.refuse_finished_state(args.out, int(index), int(count))
    resources.check_memory(scenario.devices)
    held = shard_size(scenario.devices, int(index) - 1, int(count))
    if not held:  # it would report "done" without connecting
        raise ScenarioError(f"--shard {args.shard}: holds no device ({scenario.devices:,} devices over {count} shards)")
    args.connections = _connections(args.connections, held, 1)
    credentials, secret = _shard_credentials(args), _secret(args)
    first = shard_first(scenario.devices, int(index) - 1, int(count))
    if credentials is not None and (credentials.first, credentials.count) != (first, held):
        raise ScenarioError(
            f"--credentials {args.credentials}: holds devices {_span(credentials.first, credentials.count)}, not "
            f"shard {index}/{count}'s {_span(first, held)} ({scenario.devices:,} devices); give this shard's file "
            f"(ldpsim credentials ... --shards {count})")
    signed = (f"; credentials of key id {credentials.key_id}" if credentials is not None
              else f"; credentials derived from the secret of key id {auth_key_id(secret)}" if secret else "")
    print(f"ldpsim: shard {index}/{count}: {held:,} devices "
          f"connecting to {args.connect} over {args.connections} connection(s) (giving up after "
          f"{GIVE_UP_AFTER:g} s without a collector there){signed}", file=sys.stderr, flush=True)
    if secret is not None:
        print("ldpsim: warning: --secret-file gives this process every device's credential (it could speak for "
              "all of them); give each shard only its own: ldpsim credentials SCENARIO --secret-file PATH --shards "
              f"{count} --out DIR, then --credentials DIR/{credentials_name(int(index), int(count))}",
              file=sys.stderr, flush=True)
    if not args.out:
        print("ldpsim: warning: no --out: these devices' spend is kept in this process only (a restarted process "
              "starts them with a fresh budget); give --out DIR to keep it and their state across restarts",
              file=sys.stderr, flush=True)
    outcome = asyncio.run(live.devices(scenario, host, int(port), int(index) - 1, int(count), args.connections,
                                       secret, _client_tls(args), args.out, args.resume, credentials))
    ledger = outcome.ledger
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from scenarios import tables

        path = out / f"ledger-shard-{index}-of-{count}.parquet"
        tables.write_ledger(path, ledger.rows())
        print(f"shard {index}/{count}: ledger -> {path} (ldpsim audit RUN_DIR --ledger {path} ...)", file=sys.stderr)
    spent = ledger.spend[ledger.spend > 0]
    guards = outcome.guards
    state = "done" if outcome.error is None else "stopped"
    print(f"shard {index}/{count}: {state}; per-device spend (epsilon) max {spent.max() if spent.size else 0:.4g}; "
          f"reports refused for the budget {guards['refusals']:,}, collector messages ignored "
          f"{guards['ignored']:,} (per device), undecodable collector frames {outcome.rejected:,}")
    if outcome.error is not None:  # no collector there for the clients' whole patience, or one that will not
        raise ScenarioError(outcome.error)  # serve these devices: what they spent until then is written above
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Check a finished run device by device against the reference models (scenarios/audit.py)."""
    from scenarios import audit

    seed = None if args.sample_seed is None else _int_arg("--sample-seed", args.sample_seed)
    if seed is not None and not 0 <= seed < 2**63:
        raise ScenarioError(f"--sample-seed {args.sample_seed}: must be in [0, 2^63)")
    return audit.main(args.run_dir, args.devices, args.ledger, args.json, args.quiet, args.allow_code, seed)


def cmd_privacy_audit(args: argparse.Namespace) -> int:
    """Measure empirical epsilon lower bounds on canary devices (scenarios/privacy_audit.py)."""
    from scenarios import privacy_audit

    return privacy_audit.main(args.target, _int_arg("--trials", args.trials), _int_arg("--rounds", args.rounds),
                              args.json, args.out, None if args.seed is None else _int_arg("--seed", args.seed),
                              args.set, args.quiet)


def cmd_conformance(args: argparse.Namespace) -> int:
    """Run the conformance kit on a protocol (scenarios/conformance.py)."""
    from scenarios import conformance

    only = [c.strip() for c in args.only.split(",") if c.strip()] if args.only else None
    return conformance.main(args.target, only, _int_arg("--devices", args.devices), _int_arg("--rounds", args.rounds),
                            args.set, args.json, args.quiet)


def cmd_protocols(args: argparse.Namespace) -> int:
    """List the registered protocols: built-in, then installed plugins (entry point group ldpsim.protocols)."""
    from protocols import registry

    rows = [{"name": r.name, "source": r.source, "class": f"{r.params.__module__}:{r.params.__qualname__}",
             "summary": r.summary} for r in registry.available()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width, source = max(len(r["name"]) for r in rows), max(len(r["source"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['source']:<{source}}  {r['summary']}")
    print(f"\n{len(rows)} protocols. A scenario's [protocol] name may also be module:Class (an importable "
          f"parameter class); plugins register under the entry point group {registry.ENTRY_POINT_GROUP!r}.")
    return 0


def _count(text: str) -> int:
    """An argparse type: a whole number >= 1 (connections)."""
    try:
        n = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _connections(connections: int, devices: int, fds_each: int) -> int:
    """The connections to open for ``--connections``: at most one a device (a connection carries at least one;
    a hundred million used to build as many shards first), and a ScenarioError naming the limit when this
    process may not open that many files (past ulimit -n the sockets failed mid-run)."""
    from collector.server import fd_ceiling

    connections = max(1, min(connections, devices))
    ceiling = fd_ceiling() // fds_each
    if connections > ceiling:
        raise ScenarioError(f"--connections: {connections:,} needs {connections * fds_each:,} open files; this "
                            f"process may open about {ceiling * fds_each:,} (ulimit -n)")
    return connections


def _seconds(text: str, zero: bool = False) -> float:
    """An argparse type: a finite number of seconds > 0 (>= 0 with ``zero``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>=' if zero else '>'} 0, got {text}")
    return v


def _pause(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    return _seconds(text, zero=True)


def _port(text: str) -> int:
    """An argparse type: a TCP port to listen on, 0-65535 (0: one the system picks, printed)."""
    if not text.isdecimal() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535, got {text!r}")
    return int(text)


def _int_arg(flag: str, text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise ScenarioError(f"{flag} {text!r}: expected an integer") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ldpsim", description="Simulate privacy-preserving telemetry collection.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario and write a run directory")
    run.add_argument("scenario", help="a scenario .toml file, or the name of a shipped one (e.g. quickstart)")
    run.add_argument("--out", help="run directory (default: runs/<name>-<timestamp>)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set simulation.cohort_size=1 --set seed=7")
    run.add_argument("--force", action="store_true", help="overwrite a finished run in --out")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--no-ledger-rows", action="store_true",
                     help="skip ledger.parquet and ledger.csv (one row per device and charge); spend.parquet is "
                          "always written")
    run.add_argument("--transcript", choices=("always", "auto", "never"), default="auto",
                     help="write transcript.parquet (one row per delivered report): auto (default) when devices x "
                          "rounds <= 50,000,000")
    run.add_argument("--json", action="store_true",
                     help="print summary.json on stdout (the one-line report then goes to stderr)")
    run.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local (default): this machine, [simulation] workers processes; ray: [simulation] "
                          "workers device shards (0: 2) as Ray actors (the ray extra)")
    run.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster to join with --engine ray, e.g. auto or HOST:6379 from a node of it "
                          "(default: start a local Ray instance)")
    run.set_defaults(func=cmd_run)
    cmp_ = sub.add_parser("compare", help="a protocol against its naive baseline at equal total privacy per "
                                          "device (THRESH: per-epoch randomized response)")
    cmp_.add_argument("scenario", help="a thresh scenario file or shipped name (e.g. thresh_stable)")
    cmp_.add_argument("--out", help="output directory (default: runs/<name>-compare-<timestamp>)")
    cmp_.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    cmp_.add_argument("--quiet", action="store_true", help="no progress bars")
    cmp_.add_argument("--force", action="store_true", help="overwrite a finished comparison in --out")
    cmp_.set_defaults(func=cmd_compare)

    def live_common(p: argparse.ArgumentParser) -> None:
        p.add_argument("scenario", help="a scenario file or shipped name")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
        p.add_argument("--secret-file", metavar="PATH",
                       help="deployment secret (>= 16 bytes): devices derive HMAC-SHA256(secret, id) credentials "
                            "and the collector refuses a Hello without a valid MAC (protocols/auth.py)")

    def server_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stage-timeout", type=_seconds, metavar="SECONDS", default=5.0,
                       help="real seconds a stage stays open at most (default 5)")
        p.add_argument("--read-timeout", type=_seconds, metavar="SECONDS", default=5.0,
                       help="real seconds a client may take to finish a frame it started (default 5)")
        p.add_argument("--max-connections", type=_count, metavar="N",
                       help="connections open at once (default: devices + 64, at most the open-file limit - 64); "
                            "more are closed at once and counted, or take the place of a connection that has said "
                            "no hello for a second")
        p.add_argument("--max-pending-per-host", type=_count, metavar="N",
                       help="connections of one address that have not said an accepted hello (default: half of "
                            "--max-connections); raise it when many device hosts share one address (NAT)")
        p.add_argument("--write-timeout", type=_seconds, metavar="SECONDS", default=5.0,
                       help="real seconds a connection's socket may take to accept a broadcast before it is dropped "
                            "(default 5)")
        p.add_argument("--startup-timeout", type=_seconds, metavar="SECONDS", default=30.0,
                       help="real seconds to wait for every device to connect before the first round; then the "
                            "rounds run with those connected, with a warning (default 30; none connected: exit 2)")
        p.add_argument("--hello-timeout", type=_seconds, metavar="SECONDS", default=10.0,
                       help="real seconds from connecting (TLS handshake included) to the Hello (default 10)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this certificate chain ...")
        p.add_argument("--tls-key", metavar="PEM", help="... and this private key")

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, checking the collector's certificate "
                                                       "against this CA (a self-signed certificate is its own CA)")

    lv = sub.add_parser("live", help="server and device clients in one process over loopback TCP")
    live_common(lv)
    server_options(lv)
    client_options(lv)
    lv.add_argument("--connections", type=_count, default=2, metavar="N", help="device client connections (default 2)")
    lv.add_argument("--out", help="run directory (default: runs/<name>-live-<timestamp>)")
    lv.add_argument("--force", action="store_true", help="overwrite a finished run in --out")
    lv.add_argument("--no-ledger-rows", action="store_true",
                    help="skip ledger.parquet and ledger.csv (one row per device and charge)")
    lv.set_defaults(func=cmd_live)
    sv = sub.add_parser("serve", help="the collector server alone")
    live_common(sv)
    server_options(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                                                         "interface)")
    sv.add_argument("--port", type=_port, default=7337,
                    help="TCP port to listen on (default 7337; 0: a free port, printed when serving)")
    sv.add_argument("--out", help="run directory (default: runs/<name>-serve-<timestamp>)")
    sv.add_argument("--force", action="store_true", help="overwrite a finished run in --out")
    sv.add_argument("--resume", metavar="DIR",
                    help="continue the run of a collector that stopped (killed, crashed) from the journal in its "
                         "run directory DIR, from the round after the last one it closed")
    sv.add_argument("--round-pause", type=_pause, default=0.0, metavar="SECONDS",
                    help="real seconds to wait after each round (pacing a demo or a test; default 0)")
    sv.set_defaults(func=cmd_serve)
    dv = sub.add_parser("devices", help="device clients for one shard of the population")
    live_common(dv)
    client_options(dv)
    dv.add_argument("--connect", required=True, metavar="HOST:PORT", help="the collector (ldpsim serve) to connect to")
    dv.add_argument("--shard", default="1/1", metavar="I/N", help="this process hosts shard I of N (1-based)")
    dv.add_argument("--connections", type=_count, default=1, metavar="N", help="connections this shard's devices share "
                                                                  "(default 1)")
    dv.add_argument("--out", help="directory for this shard's ledger and its saved device state "
                                  "(devices-shard-I-of-N.state: reloaded automatically when it is there)")
    dv.add_argument("--resume", action="store_true",
                    help="require the saved device state in --out (exit 2 if there is none)")
    dv.add_argument("--credentials", metavar="PATH",
                    help="this shard's device credentials, written by `ldpsim credentials` (instead of "
                         "--secret-file, which would give this process every device's credential)")
    dv.set_defaults(func=cmd_devices)
    cr = sub.add_parser("credentials", help="write each device shard's credentials to a file of its own, from the "
                                            "deployment secret (for `ldpsim devices --credentials`)")
    cr.add_argument("scenario", help="a scenario file or shipped name (its population is split into shards as "
                                     "`ldpsim devices --shard I/N` splits it)")
    cr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    cr.add_argument("--secret-file", metavar="PATH", required=True, help="the deployment secret `serve` uses")
    cr.add_argument("--shards", required=True, metavar="N", help="how many device shards (files) to write")
    cr.add_argument("--out", required=True, metavar="DIR",
                    help="directory for credentials-shard-I-of-N.bin (mode 0600, 32 bytes a device)")
    cr.add_argument("--force", action="store_true", help="overwrite credentials files already in --out")
    cr.add_argument("--quiet", action="store_true", help="no progress bar")
    cr.set_defaults(func=cmd_credentials)

    sw = sub.add_parser(
        "sweep", help="run a scenario over a grid of parameter values, repeated with derived seeds",
        description="Run SCENARIO at every point of the grid (the cross product of the --grid values), R times "
                    "each; repetition r uses the same derived seed at every point. Writes runs.jsonl, "
                    "results.csv, points.csv (mean, sd, s.e. and 95% interval per point), results.parquet, "
                    "sweep.json, failed.jsonl (if runs fail) and error_*.png to "
                    "--out. Runs go longest first to one pool of worker processes, or to a Dask cluster. Repeating "
                    "the command resumes: only runs missing from runs.jsonl are run.")
    sw.add_argument("scenario", help="a scenario .toml file (may hold a [sweep] table), or a shipped name")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="sweep a scenario key over TOML values, e.g. --grid protocol.epsilon=0.5,1,2 or "
                         "--grid 'population.groups.0.counter={dist=\"constant\",value=12},{...}'; repeatable "
                         "(cross product); replaces that key's values from the file's [sweep.grid]")
    sw.add_argument("--repeat", metavar="R", help="repetitions per grid point (overrides [sweep] repeat)")
    sw.add_argument("--workers", metavar="W",
                    help="worker processes (default: [sweep] workers, else min(2, CPUs)); 1 runs in-process")
    sw.add_argument("--cluster", metavar="ADDRESS",
                    help="run on a Dask distributed cluster instead: tcp://HOST:PORT (a running scheduler; its "
                         "workers need ldpsim installed) or local:N (N single-threaded worker processes started "
                         "for the sweep); needs the dask extra: " + install_command("dask"))
    sw.add_argument("--out", required=True, metavar="DIR", help="sweep directory (created; resumed if it "
                                                                 "holds the same sweep)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a scenario key at every grid point, e.g. --set population.devices=5000")
    sw.add_argument("--force", action="store_true", help="start over in --out, even if it holds another sweep")
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.set_defaults(func=cmd_sweep)

    au = sub.add_parser(
        "audit", help="check a finished run: replay its devices through reference models",
        description="Rebuild each audited device's values from the scenario and seed, replay it through a "
                    "plain reference model against the recorded broadcasts (downlink.jsonl), and compare with "
                    "transcript.parquet, ledger.parquet and summary.json (digest, guarantee, budget). Writes "
                    "RUN_DIR/audit.json; exit status 0 when everything agrees, 1 when not, 2 for a run "
                    "directory that cannot be audited.")
    au.add_argument("run_dir", metavar="RUN_DIR", help="a finished run directory (ldpsim run --out)")
    au.add_argument("--devices", metavar="N|all",
                    help="audit a keyed sample of N devices, or all (default: all up to 100,000, else a keyed "
                         "sample of 100,000)")
    au.add_argument("--sample-seed", metavar="S",
                    help="the key of the sample (default: a fresh random one, recorded in audit.json; give it to "
                         "repeat an audit of the same devices)")
    au.add_argument("--ledger", action="append", default=[], metavar="PATH",
                    help="a ledger.parquet written by a device shard (ldpsim devices --out); repeatable; "
                         "replaces RUN_DIR's ledger")
    au.add_argument("--json", action="store_true", help="print audit.json (and no progress bar)")
    au.add_argument("--quiet", action="store_true", help="no progress bar")
    au.add_argument("--allow-code", action="store_true",
                    help="audit a run whose scenario.json names modules to import (behaviors or a protocol given "
                         "as module:name): loading it runs that code, so only for runs you trust")
    au.set_defaults(func=cmd_audit)

    pr = sub.add_parser("protocols", help="list the registered protocols (built-in and installed plugins)")
    pr.add_argument("--json", action="store_true", help="print them as a JSON list")
    pr.set_defaults(func=cmd_protocols)

    cf = sub.add_parser(
        "conformance", help="check that a protocol has the properties every protocol must have",
        description="Run the conformance kit (scenarios/conformance.py) on a small two-group scenario of a "
                    "protocol: digests independent of the cohort split and of threads, live TCP equal to the "
                    "simulation, the wire format under fuzzing, every hostile collector and a budget, a clean "
                    "ldpsim audit, and privacy-audit lower bounds not above the claims. Every check runs whatever "
                    "the others give; exit status 1 when one fails.")
    cf.add_argument("target", metavar="PROTOCOL_OR_SCENARIO",
                    help="a protocol name (its example [protocol] table) or a scenario file or shipped name (its "
                         "[protocol] table and seed)")
    cf.add_argument("--only", metavar="CHECK[,CHECK...]", help="run only these checks (cohort_split, "
                                                               "live_equals_simulated, wire, hostile, audit, "
                                                               "privacy_audit)")
    cf.add_argument("--devices", default="400", metavar="N", help="devices of the check scenario (default 400)")
    cf.add_argument("--rounds", default="6", metavar="T", help="rounds of the check scenario (default 6)")
    cf.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the check scenario, e.g. --set protocol.epsilon=2")
    cf.add_argument("--json", action="store_true", help="print the results as JSON (no table)")
    cf.add_argument("--quiet", action="store_true", help="no progress lines")
    cf.set_defaults(func=cmd_conformance)

    pa = sub.add_parser(
        "privacy-audit", help="measure empirical epsilon lower bounds on canary devices",
        description="Run canary devices through the real device side with two inputs (one report; and over "
                    "--rounds collections: light vs heavy usage, a change vs none, two change rounds), decide "
                    "each canary's input from its whole transcript with the most powerful test available, and "
                    "report eps_lb = ln(TPR_low / FPR_high) with 99% Clopper-Pearson bounds beside the claimed "
                    "epsilon. Writes privacy_audit.json, privacy_audit.csv and a plot per protocol to --out; "
                    "exit status 1 when a lower bound exceeds its claim.")
    pa.add_argument("target", metavar="PROTOCOL_OR_SCENARIO",
                    help="a protocol name (default parameters, epsilon 1), a scenario file or shipped name (its "
                         "[protocol] table), or 'all'")
    pa.add_argument("--trials", default="100000", metavar="N", help="canaries per input (default 100,000)")
    pa.add_argument("--rounds", default="31", metavar="T", help="collections of the longitudinal games (default "
                                                                "31; 1: only the one-report game)")
    pa.add_argument("--seed", metavar="S", help="seed of the canaries (default: the scenario's, else 1)")
    pa.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the canary scenario, e.g. --set protocol.epsilon=2")
    pa.add_argument("--out", metavar="DIR", help="output directory (default: runs/privacy-audit-<target>-<time>)")
    pa.add_argument("--json", action="store_true", help="print the rows as a JSON list (no table)")
    pa.add_argument("--quiet", action="store_true", help="no progress lines")
    pa.set_defaults(func=cmd_privacy_audit)
    return ap


def _command(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except ScenarioError as exc:
        print(f"ldpsim: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "status", 2))  # 2, or 1 for an audited run directory changed after the run
    except BehaviorError as exc:  # a scripted behavior that failed during the run (agents/behavior.py)
        text = str(exc)  # (named "behavior" once: its key, population.groups[i].behavior, usually says it)
        print(f"ldpsim: error: {text if 'behavior' in text.split(':')[0] else 'behavior: ' + text}", file=sys.stderr)
        return 2
    except BudgetOverrun as exc:  # a device side (a plugin's) that charged past the budget: stopped, not sent
        print(f"ldpsim: error: privacy: {exc}", file=sys.stderr)
        return 1
    except DefinitionError as exc:  # a protocol class declaring what no runtime can run
        print(f"ldpsim: error: protocol: {exc}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:  # a plugin's device or collector side without a method it must define
        print(f"ldpsim: error: protocol: {exc or 'a method'} is not implemented: a protocol's device or collector "
              f"side must define it (README: Writing a protocol)", file=sys.stderr)
        return 2
    except (NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError, FileNotFoundError) as exc:
        # e.g. --out a/b where a is a file, or under /proc, or a folder it may not write: the path and the
        # reason, not a traceback
        print(f"ldpsim: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # any other the system raised: a name too long, a full disk, a read-only file system
        print(f"ldpsim: error: {str(exc.filename) + ': ' if exc.filename else ''}{exc.strerror or exc}",
              file=sys.stderr)
        return 2
    except MemoryError:  # past the up-front checks (a privacy audit of 2e9 trials, a data file of 1e9 digits)
        print("ldpsim: error: out of memory: the run, audit or file asks for more than this machine has",
              file=sys.stderr)
        return 2
    except OverflowError as exc:  # a number from a file beyond what a double holds (an edited summary.json)
        print(f"ldpsim: error: a number too large to compute with (beyond 1.8e308): {exc}", file=sys.stderr)
        return 2
    except RecursionError:  # tomllib and json recurse: a file or --set value of thousands of nested levels
        print("ldpsim: error: input nested too deeply (a scenario, --set/--grid value or JSON file with thousands "
              "of nested arrays or tables)", file=sys.stderr)
        return 2
    except Terminated:
        print("ldpsim: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("ldpsim: interrupted", file=sys.stderr)
        return 130
    except SystemError as exc:  # Ctrl-C inside numba's loading of a cached kernel comes out as a SystemError
        interrupt = _interrupt_in(exc)
        if interrupt is None:
            raise
        terminated = isinstance(interrupt, Terminated)  # SIGTERM there (a cold kernel cache) is still a stop
        print(f"ldpsim: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except Exception as exc:  # a plugin's or a behavior's own code that raised: where and what, in one line
        line = failure.one_line(exc)
        if line is None:  # raised in ldpsim itself: a bug, with its traceback
            raise
        print(f"ldpsim: error: {line}", file=sys.stderr)
        return 2


def _interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or :class:`Terminated`) among ``exc``'s causes, if any (a C extension that was
    interrupted re-raises it wrapped: numba's kernel loading gave "SystemError: ... returned a result with an
    exception set")."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is: the same clean-up (worker processes stopped, a partial
    run directory removed, a sweep's kept runs named), then exit status 143."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


#: commands whose SIGTERM is handled as Ctrl-C (batch jobs; the servers keep the default)
TERM_AS_INTERRUPT = ("run", "sweep", "credentials")

#: commands whose process ends without tearing the interpreter down (see _exit_now)
FAST_EXIT = ("run",)


def _is_process_entry(argv: list[str] | None) -> bool:
    """Called as the ``ldpsim`` program (the console script or ``python -m scenarios.cli``), not from Python
    code such as the tests (which pass ``argv``)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return argv is None and (name.startswith("ldpsim") or name == "cli.py")


def _exit_now(code: int) -> None:
    """End the process at once: run the atexit handlers (temporary directories, logging), flush stdout and
    stderr, then ``os._exit``, skipping the interpreter's teardown (freeing every module and the run's
    objects one by one: 0.3-0.7 s after a 3M-device run, longer than writing summary.json). Every file of
    the run directory is closed and in place before this is called. Falls back to a normal return while a
    non-daemon thread is still running."""
    if threading.active_count() > 1 and any(not t.daemon for t in threading.enumerate()
                                            if t is not threading.current_thread()):
        return
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what the interpreter's own exit would report as 120
            code = code or 120
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, unknown = ap.parse_known_args(argv)
    if unknown:  # said by the parser whose options they stood among, with its usage
        given = sys.argv[1:] if argv is None else argv
        before = given[:given.index(args.command)] if args.command in given else []
        if any(u in before for u in unknown):  # `ldpsim --bogus run ...`: the top level's (every command)
            ap.error(f"unrecognized arguments: {' '.join(unknown)}")
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if _is_process_entry(argv):  # the ldpsim program owns its process (not a caller passing argv)
        allocator.tune()
        jit.skip_blas_probe()
        if args.command in TERM_AS_INTERRUPT:
            signal.signal(signal.SIGTERM, _terminate)
    code = _command(args)
    if args.command in FAST_EXIT and getattr(args, "engine", "local") == "local" and _is_process_entry(argv):
        _exit_now(code)  # (--engine ray: Ray's own shutdown is left to the ordinary exit)
    return code


if __name__ == "__main__":
    sys.exit(main())
