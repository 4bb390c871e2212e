"""The conformance kit: the properties every protocol must have, runnable from any test suite.

A protocol (built in or a plugin, protocols/registry.py) passes when, on a small scenario of its own:

- :func:`check_cohort_split`: digests (transcript, ledger, estimates) are identical for cohort sizes 1, 7 and
  the whole population (keyed randomness: a device's reports do not depend on its neighbours);
- :func:`check_live_equals_simulated`: the live runtime over loopback TCP gives the simulator's digests;
- :func:`check_wire`: every message of a run survives the wire format (encode, decode, equal), and mutated
  frames are rejected with ``WireError`` or decode to a message the collector takes or rejects with
  ``ProtocolError``, never another exception;
- :func:`check_hostile`: against every hostile collector behavior the run survives, no device spends past
  the protocol's guarantee, the hostile messages are ignored (and counted) and the ledger is the honest
  run's;
- :func:`check_audit`: ``ldpsim audit`` replays every device through the protocol's reference model
  (``reference_model`` on its parameter class, or a built-in one) and finds the run clean;
- :func:`check_privacy_audit`: ``ldpsim privacy-audit``'s lower bounds are not above the claims.

:func:`run_conformance` runs them all (``keep_going``: every check, then one error naming each that failed). A
plugin's tests call it (or one check per test) on a scenario from :func:`scenario_for`; ``ldpsim conformance
PROTOCOL_OR_SCENARIO`` (:func:`main`) runs them from the command line, one line a check. It drives the runtimes, so it lives with them (scenarios/), not in the sans-IO protocols/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from protocols import keyed
from protocols.keyed import Purpose, stream_key
from protocols.ledger import exceeds

__all__ = ["CHECKS", "ConformanceError", "check_audit", "check_cohort_split", "check_hostile",
           "check_live_equals_simulated", "check_privacy_audit", "check_wire", "run_conformance", "scenario_for"]


class ConformanceError(AssertionError):
    """A protocol that does not have a property every protocol must have."""


def _fail(check: str, message: str) -> ConformanceError:
    return ConformanceError(f"{check}: {message}")


def scenario_for(protocol: dict[str, Any], devices: int = 400, rounds: int = 6, seed: int = 7,
                 **overrides: Any) -> Any:
    """A small two-group scenario for the [protocol] table ``protocol``, lossless, with a change at round 4:
    values in [0, max_value] (or daily bits for a protocol whose parameter class says ``collects_bits``;
    app weights for one with ``counters``). ``overrides`` are dotted scenario keys (as ``--set``)."""
    from protocols import registry
    from scenarios import schema

    cls = registry.lookup(str(protocol.get("name", ""))).params
    m = float(protocol.get("max_value", 1.0))
    bits = bool(getattr(cls, "collects_bits", False))

    def counter(lo: float, hi: float) -> dict[str, Any]:
        return ({"dist": "bernoulli", "p": (lo + hi) / 2 / m} if bits
                else {"dist": "uniform", "low": lo, "high": hi})

    groups: list[dict[str, Any]] = [
        {"name": "a", "share": 0.6, "counter": counter(0.1 * m, 0.4 * m)},
        {"name": "b", "share": 0.4, "counter": counter(0.4 * m, 0.9 * m)},
    ]
    if "counters" in protocol:
        for g in groups:
            g["apps"] = [1.0 + j for j in range(int(protocol["counters"]))]
    data: dict[str, Any] = {
        "name": f"conformance-{protocol.get('name')}", "seed": seed, "rounds": rounds,
        "population": {"devices": devices, "groups": groups},
        "changes": [{"round": min(4, rounds), "group": "b", "fraction": 0.5, "counter": counter(0.0, 0.2 * m)}],
        "protocol": dict(protocol),
        "network": {"latency": 0.1, "deadline": 3.0},
        "simulation": {"cohort_size": max(1, devices // 4), "round_seconds": 100},
        "analysis": {"attacks": False},
    }
    data = schema.apply_overrides(data, [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                                         for k, v in overrides.items()])
    return schema.parse(data)


def _with(sc: Any, *overrides: str) -> Any:
    from scenarios import schema

    return schema.parse(schema.apply_overrides(sc.raw, list(overrides)))


def _summary(sc: Any) -> dict[str, Any]:
    from scenarios import output, runner

    return output.summary(runner.run(sc))


# ------------------------------------------------------------------------------------------------ checks
def check_cohort_split(sc: Any) -> dict[str, Any]:
    """Digests identical for cohort sizes 1, 7 and all devices, and for cohorts of 7 answered by 3 threads
    (device sides must not share mutable state across cohorts); returns the digests."""
    def digests_of(size: int, threads: int = 1) -> dict[str, Any]:
        return _summary(dataclasses.replace(sc, simulation=dataclasses.replace(
            sc.simulation, cohort_size=size, threads=threads, workers=1)))["digests"]

    digests = {size: digests_of(size) for size in (1, 7, sc.devices)}
    if not digests[1] == digests[7] == digests[sc.devices]:
        raise _fail("cohort split", f"digests differ between cohort sizes 1, 7 and {sc.devices}: {digests}")
    threaded = digests_of(7, threads=3)
    if threaded != digests[7]:
        raise _fail("cohort split", f"digests differ when 3 threads answer for the cohorts: {threaded} != {digests[7]}")
    return digests[1]


def check_live_equals_simulated(sc: Any, connections: int = 3) -> dict[str, Any]:
    """The live runtime (server and clients over loopback TCP) gives the simulator's digests."""
    from collector.server import LiveSettings
    from scenarios import live, output

    sim = _summary(sc)
    settings = LiveSettings(stage_timeout=5.0, read_timeout=1.0, startup_timeout=20.0)
    got = output.summary(asyncio.run(live.run_embedded(sc, connections=connections, settings=settings)))
    if got["digests"] != sim["digests"]:
        raise _fail("live equals simulated", f"live digests {got['digests']} != simulated {sim['digests']}")
    if got["reports"]["accepted"] != sim["reports"]["accepted"]:
        raise _fail("live equals simulated", f"{got['reports']['accepted']} reports accepted live, "
                                             f"{sim['reports']['accepted']} simulated")
    return got["digests"]


def check_wire(sc: Any, mutations: int = 2000, seed: int = 0) -> dict[str, int]:
    """Round 1's request and report batch round-trip through the wire format; mutated frames fail cleanly."""
    from protocols import wire
    from protocols.base import ProtocolError

    params = sc.protocol
    devices = params.make_devices(sc.seed, np.arange(min(sc.devices, 64)), sc.limits)
    collector = params.make_collector(min(sc.devices, 64))
    request = collector.request(1, 1e9)
    frames = [wire.encode(request)]
    values = np.full(devices.device_ids.size, 0.5 * params.max_value)
    if getattr(params, "counters", None):
        values = np.full((devices.device_ids.size, params.counters), 0.5 * params.max_value / params.counters)
    if hasattr(devices, "observe"):
        for day in range(1, int(getattr(params, "epoch_length", 1)) + 1):
            devices.observe(day, values)
    batch, _ = devices.respond(request, int(getattr(params, "epoch_length", 1)), values, 0.0)
    if batch is not None:
        frames.append(wire.encode(batch))
        back = wire.decode(frames[-1])
        if not (isinstance(back, type(batch)) and back.round == batch.round and back.protocol == batch.protocol
                and np.array_equal(back.devices, batch.devices)
                and all(np.array_equal(np.asarray(back.columns[k]), np.asarray(batch.columns[k]))
                        for k in batch.columns)):
            raise _fail("wire", "a report batch does not decode to itself")
    if wire.decode(frames[0]) != request:
        raise _fail("wire", "a collection request does not decode to itself")
    counts = {"rejected": 0, "decoded": 0, "taken": 0, "refused": 0}
    key = stream_key(seed, Purpose.REPORT, 0xF022)  # keyed draws: mutation i is a pure function of (seed, i)
    for i in range(mutations):
        u = keyed.uniform(key, np.arange(8 * i, 8 * i + 8, dtype=np.uint64))
        data = bytearray(frames[int(u[0] * len(frames))])
        for j in range(1 + int(u[1] * 3)):
            data[int(u[2 + 2 * j] * len(data))] = int(u[3 + 2 * j] * 256)
        try:
            msg = wire.decode(bytes(data))
        except wire.WireError:
            counts["rejected"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
            raise _fail("wire", f"a mutated frame raised {type(exc).__name__}: {exc}") from exc
        counts["decoded"] += 1
        if type(msg).__name__ == "ReportBatch":
            fresh = params.make_collector(min(sc.devices, 64))
            fresh.request(1, 1e9)
            try:
                fresh.receive(msg)
                counts["taken"] += 1
            except ProtocolError:
                counts["refused"] += 1
            except Exception as exc:  # noqa: BLE001
                raise _fail("wire", f"the collector raised {type(exc).__name__} on a mutated batch: {exc}") from exc
    return counts


def check_hostile(sc: Any) -> dict[str, float]:
    """Every common hostile behavior: within the guarantee, messages ignored, the honest run's ledger; and a
    ``[privacy] budget`` of half the honest run's largest spend holds under an honest and a replaying collector
    (a device side must ask ``Guard.affordable`` before it reports: one that charges past the budget stops the
    run with ``BudgetOverrun``)."""
    from protocols.guard import BudgetOverrun
    from scenarios import schema

    honest = _summary(sc)
    out = {}
    budget = float(honest["privacy"]["max_spend"]) / 2
    for behavior in ("honest", "replay") if budget > 0 else ():
        try:
            s = _summary(dataclasses.replace(sc, budget=budget, behavior=behavior))
        except BudgetOverrun as exc:
            raise _fail("budget", f"{behavior} collector, budget {budget:.6g}: {exc}") from None
        pv = s["privacy"]
        if not pv["within_budget"] or exceeds(pv["max_spend"], budget):
            raise _fail("budget", f"{behavior} collector: a device spent {pv['max_spend']} > budget {budget:.6g}")
        out[f"budget under {behavior}"] = float(pv["max_spend"])
    for behavior in schema.BEHAVIORS:
        if behavior == "honest" or behavior in schema.PROTOCOL_BEHAVIORS:
            continue
        s = _summary(dataclasses.replace(sc, behavior=behavior))
        pv = s["privacy"]
        if not pv["within_guarantee"] or exceeds(pv["max_spend"], pv["guarantee"]):
            raise _fail("hostile", f"{behavior}: a device spent {pv['max_spend']} > guarantee {pv['guarantee']}")
        if not pv["ignored_messages"]:
            raise _fail("hostile", f"{behavior}: the devices ignored no hostile message (did they answer it?)")
        if s["digests"]["ledger"] != honest["digests"]["ledger"]:
            raise _fail("hostile", f"{behavior}: the ledger differs from the honest run's")
        out[behavior] = float(pv["max_spend"])
    for behavior in getattr(sc.protocol, "collector_behaviors", ()):
        s = _summary(_with(sc, f'collector.behavior="{behavior}"'))
        if not s["privacy"]["within_guarantee"]:
            raise _fail("hostile", f"{behavior}: a device spent past the guarantee")
        out[behavior] = float(s["privacy"]["max_spend"])
    return out


def check_audit(sc: Any, directory: str | Path | None = None) -> dict[str, Any]:
    """``ldpsim audit`` of a run of ``sc`` (every device) is clean."""
    from protocols import reference
    from scenarios import audit, output, runner

    try:
        reference.model_of(sc.protocol)
    except ValueError as exc:  # nothing to replay the devices with (said before a run it could not audit)
        raise _fail("audit", str(exc)) from None

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(directory) if directory is not None else Path(tmp) / "run"
        out.mkdir(parents=True, exist_ok=True)
        output.write_run_dir(runner.run(sc), out, transcript="always")
        record = audit.audit(out, devices="all", allow_code=True)  # the protocol under test is the caller's own code
    if record.get("verdict") != "clean":
        raise _fail("audit", "ldpsim audit is not clean: " + "\n".join([audit.describe(record),
                                                                          *audit.mismatch_lines(record)]))
    return record


def check_privacy_audit(sc: Any, trials: int = 3000, rounds: int = 6, seed: int = 7) -> list[Any]:
    """``ldpsim privacy-audit``: no game's lower bound above its claim (the scenario's [protocol] table)."""
    from scenarios import privacy_audit

    if getattr(sc.protocol, "central", False):
        return [{"applies": False, "why": "central model: a device's report is its raw value, the guarantee is on "
                                          "the curator's releases"}]
    table = dict(sc.raw["protocol"])
    rows = [privacy_audit.audit_game(table, game, trials, seed) for game in privacy_audit.games(rounds)]
    over = [r for r in rows if r.exceeds]
    if over:
        raise _fail("privacy audit", "; ".join(f"{r.game}: eps_lb {r.eps_lb:.3f} > claimed {r.claimed}"
                                               for r in over))
    return rows


CHECKS: dict[str, Callable[[Any], Any]] = {
    "cohort_split": check_cohort_split,
    "live_equals_simulated": check_live_equals_simulated,
    "wire": check_wire,
    "hostile": check_hostile,
    "audit": check_audit,
    "privacy_audit": check_privacy_audit,
}


def _chosen(only: Sequence[str] | None) -> list[str]:
    """The checks to run, in CHECKS order; ValueError naming a check that does not exist."""
    unknown = sorted(set(only or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"no conformance check {', '.join(map(repr, unknown))} (checks: {', '.join(CHECKS)})")
    return [name for name in CHECKS if only is None or name in only]


def _each(sc: Any, names: Sequence[str],
          starting: Callable[[str], None] | None = None) -> Iterator[tuple[str, Any, ConformanceError | None, float]]:
    """Each named check run on ``sc``, in order: (name, its figures or None, its failure or None, seconds);
    ``starting`` is told each name first."""
    for name in names:
        if starting is not None:
            starting(name)
        t0 = time.perf_counter()
        try:
            figures, failure = CHECKS[name](sc), None
        except ConformanceError as exc:
            figures, failure = None, exc
        except Exception as exc:  # the protocol under test raised (a plugin's code), or the check could not run
            from scenarios.failure import describe

            figures, failure = None, _fail(name, f"raised {describe(exc) or f'{type(exc).__name__}: {exc}'}")
            failure.__cause__ = exc  # a test suite's report shows the traceback
        yield name, figures, failure, time.perf_counter() - t0


def run_conformance(sc: Any, only: Sequence[str] | None = None, keep_going: bool = False) -> dict[str, Any]:
    """Every check (or those named in ``only``) on ``sc``; returns each check's figures. A failure raises
    ConformanceError at once, or with ``keep_going`` after every check has run, naming each that failed."""
    out: dict[str, Any] = {}
    failed: list[str] = []
    names = _chosen(only)
    for name, figures, failure, _ in _each(sc, names):
        if failure is None:
            out[name] = figures
        elif not keep_going:
            raise failure
        else:
            failed.append(str(failure))
    if failed:
        raise ConformanceError(f"{len(failed)} of {len(names)} checks failed:\n" + "\n".join(failed))
    return out


def main(target: str, only: Sequence[str] | None, devices: int, rounds: int, overrides: Sequence[str],
         as_json: bool = False, quiet: bool = False) -> int:
    """``ldpsim conformance``: every check on a small scenario of ``target``'s protocol (a protocol name: its
    example table; or a scenario file or shipped name: its [protocol] table and seed), each run whatever the
    others gave; one line a check (or a JSON list); exit status 1 when one failed."""
    import json
    import sys

    from scenarios import privacy_audit
    from scenarios.schema import ScenarioError

    try:
        names = _chosen(only)
    except ValueError as exc:
        raise ScenarioError(f"--only: {exc}") from None
    if devices < 20 or rounds < 2:
        raise ScenarioError(f"--devices {devices} --rounds {rounds}: the checks need at least 20 devices and "
                            f"2 rounds")
    privacy_audit.require_target(target)
    table, seed = privacy_audit.protocol_table(target)
    sc = scenario_for(table, devices, rounds, seed)
    if overrides:
        sc = _with(sc, *overrides)
    say = None if (quiet or as_json) else (lambda name: print(f"checking {name} ...", file=sys.stderr, flush=True))
    rows: list[dict[str, Any]] = [{"check": name, "passed": failure is None, "seconds": round(seconds, 2),
                                   "error": None if failure is None else str(failure)}
                                  for name, _, failure, seconds in _each(sc, names, say)]
    if as_json:
        print(json.dumps({"protocol": sc.protocol.name, "devices": sc.devices, "rounds": sc.rounds,
                          "checks": rows}, indent=1))
    else:
        width = max(len(r["check"]) for r in rows)
        for r in rows:
            verdict = "passed" if r["passed"] else "FAILED"
            print(f"{r['check']:<{width}}  {verdict}  {r['seconds']:6.1f} s"
                  + ("" if r["passed"] else f"  {r['error'].splitlines()[0]}"))
        failed = sum(not r["passed"] for r in rows)
        print(f"\n{sc.protocol.name}: {len(rows) - failed} of {len(rows)} checks passed "
              f"({sc.devices:,} devices x {sc.rounds} rounds)")
    return 1 if any(not r["passed"] for r in rows) else 0
