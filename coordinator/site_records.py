"""What a summary site keeps of its devices (``sites.mode: summary``; docs/PROTOCOL.md §20).

In an exact run the central coordinator keeps every device's records (what its adopted
updates measured, :data:`~edgepfl.aggregation.UPDATE_HISTORY`) in its state and hands a site
those of the devices it samples. A summary site keeps them itself, as the central round's
close would have kept them: the records of a round are *pending* until a later task says
the site's sum of that round went into an adopted state (:attr:`~edgepfl.protocol.site.SiteSample.kept`),
and then kept with the first round's cap measured on the median that task carries (the
median of the adopted state's changes); a sum never adopted leaves nothing. The book is one JSON
file written atomically after each change, so a restarted aggregator judges its devices
as before; an unreadable one is set aside and the site starts afresh (a device without a
record is held to the fleet's median, never let further).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from edgepfl.aggregation import OwnRecord
from edgepfl.aggregation.contract import OWN_HISTORY
from edgepfl.atomic import write_json
from edgepfl.methods import SitePart

log = logging.getLogger("edgepfl.aggregator")
#: the book's file in the aggregator's ``state_dir``
RECORDS_FILE = "records.json"


class SiteRecords:
    """A summary site's devices' records: kept ones, and the last round's pending ones."""

    def __init__(self, folder: Path | None):
        #: the book's file (None: kept in memory, forgotten on restart)
        self.path = None if folder is None else Path(folder) / RECORDS_FILE
        #: device -> its kept records, newest last (as ``UPDATE_HISTORY`` holds them)
        self.history: dict[str, list] = {}
        #: the last round's records until the central round says it adopted them
        self.pending: dict | None = None
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
            history = {str(a): [OwnRecord.from_json(r).to_json() for r in rows] for a, rows in doc["history"].items()}
            pending = doc.get("pending")
            if pending is not None:
                pending = {"round": int(pending["round"]), "records": {
                    str(a): OwnRecord.from_json(r).to_json() for a, r in pending["records"].items()},
                    "newcomers": [str(a) for a in pending["newcomers"]],
                    "vs_median": None if pending["vs_median"] is None else float(pending["vs_median"])}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = path.with_suffix(".unreadable")
            path.replace(aside)
            log.error("the site's records in %s cannot be read (%s); set aside as %s, starting without records",
                      path, exc, aside.name)
            return
        self.history, self.pending = history, pending

    def for_round(self, agents: Iterable[str]) -> tuple[dict[str, list], OwnRecord | None]:
        """What a round judges ``agents`` by: their kept records, and what one without any is
        judged against (the site's largest, as the central round gives the fleet's)."""
        records = {a: list(self.history[a]) for a in sorted(set(agents)) if a in self.history}
        newcomer = OwnRecord.largest(r for r in map(OwnRecord.typical, self.history.values()) if r is not None)
        return records, newcomer

    def settle(self, kept: int | None, typical: float | None) -> None:
        """A task came: keep the pending round's records if ``kept`` is that round (its sum is in
        an adopted state; a first round's cap measured on ``typical``, that state's median
        change), else forget them."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending["round"] == kept:
            vs_median = pending["vs_median"]
            first_cap = vs_median * typical if vs_median is not None and typical is not None else None
            for agent, record in sorted(pending["records"].items()):
                if first_cap is not None:
                    cap = typical if agent in pending["newcomers"] else first_cap
                    record = [min(record[0], cap), record[1]]
                self.history[agent] = (self.history.get(agent, []) + [record])[-OWN_HISTORY:]
        self._save()

    def hold(self, round: int, part: SitePart, first_vs_median: float | None) -> None:
        """The records of ``round``'s summed updates, pending until their sum is adopted;
        ``first_vs_median``: the bound's ``vs_median`` when the round was judged without the
        fleet's median (its records are then capped as the central close caps a first round's)."""
        self.pending = {"round": round,
                        "records": {d.agent_id: list(d.record) for d in part.devices if d.record is not None},
                        "newcomers": sorted(d.agent_id for d in part.devices if d.clipped_newcomer),
                        "vs_median": first_vs_median}
        self._save()

    def _save(self) -> None:
        if self.path is not None:
            write_json(self.path, {"history": self.history, "pending": self.pending})


__all__ = ["RECORDS_FILE", "SiteRecords"]
