"""The one converter between the core's fleet records and what a state store holds (JSON)."""

from __future__ import annotations

import json
import math
from typing import Any

from controller.core.fleet import EvidenceEntry, EvidenceExport

# Bumped when the stored shape changes; a record of another version is skipped, not misread.
FORMAT = 1


class StoredRecordError(ValueError):
    """A stored record could not be read; the message says why (the record is skipped)."""


def export_to_json(export: EvidenceExport) -> str:
    return json.dumps({
        "format": FORMAT, "sidecar": export.sidecar, "at": export.at,
        "entries": [[e.traffic_class, e.draft, list(e.accepts), list(e.rejects)]
                    for e in export.entries],
    }, separators=(",", ":"), allow_nan=False)


def export_from_json(text: str | bytes) -> EvidenceExport:
    """StoredRecordError for anything that is not a well-formed export of this format."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not an evidence record of format {FORMAT}")
        at = float(raw["at"])
        if not math.isfinite(at):
            raise StoredRecordError("its time is not finite")
        entries = tuple(EvidenceEntry(str(c), str(d), tuple(float(x) for x in a),
                                      tuple(float(x) for x in r))
                        for c, d, a, r in raw["entries"])
        return EvidenceExport(str(raw["sidecar"]), at, entries)
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise StoredRecordError(f"malformed evidence record: {exc}") from exc
