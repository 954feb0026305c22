"""Put the trained default model into the package: export the target that train_target.py wrote
and the drafter that train_drafter.py wrote (fp16 storage, compute fp32) into
src/hybrid_npu/models/default/, and check the 40 MB ceiling.

    python scripts/train/build_embedded_model.py TARGET_DIR DRAFTER_DIR [--mtp MTP_DIR]
    python scripts/train/build_embedded_model.py TARGET_DIR --mtp MTP_DIR --mtp-only

--mtp: the MTP head train_mtp.py wrote for this target (mtp.* tensors), shipped beside the EAGLE-3
drafter in mtp/ (the EAGLE-3 drafter stays the default; hybrid_npu.load_engine(..., drafter="mtp") picks it).
--mtp-only: replace only the package's mtp/ (and its training record), keeping its target and
EAGLE-3 drafter byte for byte: the int8 drafter cannot be rebuilt from the package
(scripts/train/checkpoint_from_export.py gives the target back, not it). TARGET_DIR must be the target the
package holds (its exported weights are compared), since the head was trained against it.

--graphs-only: re-export TARGET_DIR's graphs with this tree's builders and replace the package's
graphs/*.onnx that changed (and their model.json entries), keeping weights.bin, drafter/ and mtp/
byte for byte: how a faster graph reaches the shipped model although its int8 drafter cannot be
rebuilt. TARGET_DIR must be the package's target (scripts/train/checkpoint_from_export.py rebuilds it;
the exported weights.bin is compared).

The tiny model fits one NPU part, so no profile-specific graphs are needed: with an NPU profile
the runtime compiles the prefill (and verify) graph for the HTP on first load.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from hybrid_npu import integrity
from hybrid_npu.cli_common import report
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export

PROG = "build_embedded_model.py"
CEILING_BYTES = 40 * 2**20
SOURCE_MODEL = Path(__file__).resolve().parents[2] / "src" / "hybrid_npu" / "models" / "default"
# The draft shape is measured with scripts/bench/bench_speculative.py on this pair (its chat rows: 16
# held-out prompts). A chain: this drafter's distributions are flat, so a top-4 tree's node budget
# goes to shallow siblings (after the re-export with the sized CPU verify: the depth-6 chain 3.06x
# plain every step, the tree 1.9x). Depth 14: the chain is accepted far down (5.6-5.9 tokens a round
# of at most 7 at depth 6), and on this tiny target a verify node costs little (15 nodes 8-9 ms a
# round against 6-7 for 7), so on the chat prompts the depth-14 chain emits 8.8 a round and ran
# 1.68x plain adaptive against 1.47x for depth 6 (8 paired repeats, docs/speculation.md, fifteenth
# pass). The policy still picks each round's depth up to it (at 500 tokens of source, where rounds
# accept ~2, adaptive depth <= 14 read 1.01x and depth <= 6 1.03x). VERIFY_NODES bounds the draft
# (the NPU's static verify graph, and the engine's cap on total_tokens: N - 1).
VERIFY_NODES = 16
DRAFT_SHAPE = {"top_k": 1, "depth": 14, "total_tokens": 14}
# The drafters' weights: int8 (MatMulNBits) beside the fp16-stored, fp32-computed target. A drafter
# call reads its weights from cache every level (~7.5 MB at fp32 here); at int8 a depth-14 chain
# drafted in 2.7 ms a round against 5.2, acceptance the same (8.9 vs 8.8 a round), 2.08x plain
# against 1.82x on the chat prompts (6 paired repeats, docs/speculation.md). The
# shipped mtp/ was built before this (fp16); a rebuild with --mtp quantises it too.
DRAFTER_WEIGHTS = "int8"


def training_record(directory: Path) -> dict | None:
    """A train_log.json without its per-step curves (numbers quoted in the README travel with the model)."""
    f = directory / "train_log.json"
    if not f.exists():
        return None
    return {k: v for k, v in json.loads(f.read_text()).items() if not isinstance(v, list)}


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def write_records(out: Path, manifest: dict, training: dict) -> None:
    """training.json, then the integrity record over every file (training.json among them), then model.json."""
    (out / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    manifest["integrity"] = integrity.record(out)
    (out / "model.json").write_text(json.dumps(manifest, indent=1))


def check_same_target(fresh: dict, manifest: dict, target: Path, out: Path) -> None:
    """A partial rebuild keeps the package's weights: the fresh export's must be the same bytes."""
    weights = "graphs/weights.bin"
    if fresh["integrity"]["files"][weights] != manifest["integrity"]["files"][weights]:
        raise UserError(f"{target} is not the target in {out} (its exported {weights} differs): give the "
                        "checkpoint the package was built from (scripts/train/checkpoint_from_export.py rebuilds it)")


def replace_mtp(target: Path, mtp: Path, out: Path) -> None:
    """Export target + mtp into a scratch directory and move only its mtp/ into the package at out."""
    manifest = json.loads((out / "model.json").read_text())
    if "mtp" not in manifest.get("drafters", {}):
        raise UserError(f"{out} ships no MTP head to replace: build it with TARGET_DIR DRAFTER_DIR --mtp MTP_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp) / "export"
        fresh = export(target, fresh_dir, dtype="fp16", progress=print, verify=VERIFY_NODES, mtp=mtp,
                       drafter_weights=DRAFTER_WEIGHTS)
        check_same_target(fresh, manifest, target, out)
        size = tree_bytes(out) - tree_bytes(out / "mtp") + tree_bytes(fresh_dir / "mtp")
        if size > CEILING_BYTES:
            raise UserError(f"with this head the package would be {size / 2**20:.1f} MiB, over the "
                            f"{CEILING_BYTES / 2**20:.0f} MiB ceiling; the package is left as it was")
        # the new head beside the old one first: a failed copy leaves the package as it was
        shutil.rmtree(out / "mtp.new", ignore_errors=True)  # (left by a copy that failed before)
        shutil.copytree(fresh_dir / "mtp", out / "mtp.new")
        shutil.rmtree(out / "mtp")
        (out / "mtp.new").rename(out / "mtp")
        if manifest["drafter"]["kind"] == "mtp":  # the default drafter: the manifest describes it too
            manifest["drafter"] = fresh["drafter"]
    record = out / "training.json"
    training = json.loads(record.read_text()) if record.exists() else {}
    training["mtp"] = training_record(mtp)
    write_records(out, manifest, training)


def replace_graphs(target: Path, out: Path) -> list[str]:
    """Export target into a scratch directory and move the graphs that differ into the package at out."""
    manifest = json.loads((out / "model.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        mtp = None
        if "mtp" in manifest.get("drafters", {}):  # its graphs carry the final tap the MTP head reads; any
            # head with the package's config makes the exporter build them so (the head is not shipped)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
            from random_checkpoint import make_random_mtp
            from hybrid_npu.config import ModelConfig
            mtp = make_random_mtp(ModelConfig.from_dict(manifest["config"]), Path(tmp) / "mtp_for_taps")
        fresh_dir = Path(tmp) / "export"
        fresh = export(target, fresh_dir, dtype="fp16", progress=print, verify=VERIFY_NODES, mtp=mtp)
        check_same_target(fresh, manifest, target, out)
        old, new = manifest["integrity"]["files"], fresh["integrity"]["files"]
        if set(fresh["graphs"]) != set(manifest["graphs"]):
            raise UserError(f"this tree exports graphs {sorted(fresh['graphs'])}, the package has "
                            f"{sorted(manifest['graphs'])}: rebuild the whole package")
        changed = [f for f in new if f.startswith("graphs/") and f.endswith(".onnx") and new[f] != old.get(f)]
        for f in changed:  # each beside the old one first: a failed copy leaves that graph as it was
            shutil.copyfile(fresh_dir / f, out / (f + ".new"))
            (out / (f + ".new")).replace(out / f)
        manifest["graphs"] = fresh["graphs"]
    record = out / "training.json"
    write_records(out, manifest, json.loads(record.read_text()) if record.exists() else {})
    return changed


def build(args) -> int:
    manifest = export(args.target, args.out, dtype="fp16", drafter=args.drafter, force=True, progress=print,
                      verify=VERIFY_NODES, mtp=args.mtp, drafter_weights=DRAFTER_WEIGHTS)
    manifest["drafter"]["draft_shape"] = DRAFT_SHAPE
    # training records travel with the model they describe (numbers quoted in the README)
    training = {}
    for name, d in (("target", args.target), ("drafter", args.drafter), ("mtp", args.mtp)):
        if d is not None and (record := training_record(d)) is not None:
            training[name] = record
    write_records(args.out, manifest, training)
    size = tree_bytes(args.out)
    print(f"embedded model: {size / 2**20:.1f} MiB in {args.out}")
    if size > CEILING_BYTES:
        shutil.rmtree(args.out)
        print(f"over the {CEILING_BYTES / 2**20:.0f} MiB ceiling; removed", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("drafter", type=Path, nargs="?", help="the EAGLE-3 drafter train_drafter.py wrote")
    # the source tree's package, not hybrid_npu.DEFAULT_MODEL: with a non-editable install that is the
    # installed copy, which the next `pip install .` overwrites with the source tree's
    ap.add_argument("--out", type=Path, default=SOURCE_MODEL)
    ap.add_argument("--mtp", type=Path, help="an MTP head for this target (train_mtp.py's output) to ship too")
    ap.add_argument("--mtp-only", action="store_true", help="replace only the package's mtp/ with --mtp's head")
    ap.add_argument("--graphs-only", action="store_true",
                    help="replace only the package's target graphs that this tree exports differently")
    args = ap.parse_args(argv)
    try:
        if args.graphs_only:
            if args.drafter is not None or args.mtp is not None or args.mtp_only:
                raise UserError("--graphs-only takes TARGET_DIR only")
            changed = replace_graphs(args.target, args.out)
            print(f"replaced {', '.join(changed) if changed else 'nothing (the graphs are current)'} in {args.out}")
            return 0
        if args.mtp_only:
            if args.mtp is None or args.drafter is not None:
                raise UserError("--mtp-only takes TARGET_DIR and --mtp MTP_DIR, no DRAFTER_DIR")
            replace_mtp(args.target, args.mtp, args.out)
            return 0
        if args.drafter is None:
            raise UserError("give DRAFTER_DIR (or --mtp-only with --mtp)")
    except UserError as e:
        return report(PROG, e)
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
