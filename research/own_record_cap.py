"""The own-record ratchet (#52 item 1), tried and not built (research/RESULTS.md, "Honest clips
in synchronous rounds: the own record"). ``A``: the product. ``B CAP``: a clipped update records
the change it was clipped to (not at most the record before it, ``OwnRecord.at_most``), and a
device's own record widens its bound to at most ``CAP`` times the fleet's limit. The poisoning
study's fleet (FedAvg, digits, four devices, 15 rounds), clean / attacker excluded / noise at
the largest change announcing 2^24 / reversal / label flip, under ``centered_clip`` and the
mean, seeds 0-2; prints each run's honest accuracy and clipped updates. ``C 0``: a device's
record of its change is the largest of its last three adopted changes instead of their lower
median (session 45).

    OMP_NUM_THREADS=1 python research/own_record_cap.py A 0
    OMP_NUM_THREADS=1 python research/own_record_cap.py B 4      # and B 16

About 2 minutes a variant on one core.
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgepfl.aggregation import contract  # noqa: E402

variant, cap = sys.argv[1], float(sys.argv[2])
if variant == "B":
    contract.OwnRecord.at_most = lambda self, before, fleet_change=None: self if before is not None else (
        self if fleet_change is None else contract.OwnRecord(min(self.change, fleet_change), self.statistics))
    orig = contract.UpdateBound.relative_limit
    def rel(self, own=None):
        out = orig(self, own)
        if out is None or self.fleet_limit_ is None:
            return out
        return (min(out[0], cap * self.fleet_limit_), out[1])
    contract.UpdateBound.relative_limit = rel
elif variant == "C":  # the record's change: the largest of the last three adopted, not their lower median
    plain_typical = contract.OwnRecord.typical.__func__

    def typical(cls, entries):
        entries = list(entries)
        record = plain_typical(cls, entries)
        if record is None:
            return None
        return cls(max(float(change) for change, _ in entries), record.statistics)
    contract.OwnRecord.typical = classmethod(typical)
import poisoning  # noqa: E402

rows = []
for seed in (0, 1, 2):
    for rule in ("centered_clip", "mean"):
        for strategy in ("none", "excluded", "noise_2^24", "sign_flip", "label_flip_2^24"):
            rec = poisoning.run_one("digits", rule, strategy, 15, seed, Path(tempfile.mkdtemp()))
            rows.append((seed, rule, strategy, rec.get("honest_accuracy"), rec.get("clipped")))
            print(variant, cap, seed, rule, strategy, round(100 * rec["honest_accuracy"], 1), "clipped",
                  rec.get("clipped"), flush=True)
out = Path(__file__).resolve().parent / "results" / f"own_record_cap_{variant}_{cap:g}.json"
out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1))
