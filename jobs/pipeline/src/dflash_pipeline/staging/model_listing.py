"""`dflash-model-files.json`: what `stage-model` staged under a model prefix, written last as its commit point.

    {"format": "dflash-model-files/1", "source": "/models/Qwen3.6-27B", "written_at": "2026-05-01T10:00:00Z",
     "total_bytes": 55012345678,
     "files": [{"name": "config.json", "size": 1234, "sha256": "9f...", "etag": "5d41..."}, ...]}

Each record says the stored object was read back and had that sha256. The store's version tag (`etag`, S3's ETag)
ties the record to the object it was checked on: an object rewritten since, even with bytes of the same size, has
another tag and is checked again instead of trusted. While a staging is under way the same records accumulate in
`dflash-model-files.partial.json`, so an interrupted staging resumes without reading back what it had verified.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectNotFoundError, ObjectStore

LISTING_NAME = "dflash-model-files.json"
PARTIAL_NAME = "dflash-model-files.partial.json"
LISTING_FORMAT = "dflash-model-files/1"


@dataclass(frozen=True)
class FileRecord:
    """One verified object: its name under the prefix, size, sha256 and the store's version tag when checked."""

    name: str
    size: int
    sha256: str
    etag: str = ""


@dataclass
class Listing:
    """The files of a staged model, by name."""

    source: str
    files: dict[str, FileRecord] = field(default_factory=dict)
    written_at: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files.values())

    def to_bytes(self) -> bytes:
        data = {"format": LISTING_FORMAT, "source": self.source,
                "written_at": self.written_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "total_bytes": self.total_bytes,
                "files": [asdict(self.files[name]) for name in sorted(self.files)]}
        return (json.dumps(data, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> Listing:
        """Parse a listing; ConfigError when it is not one this command wrote (the prefix holds something else)."""
        try:
            doc = json.loads(data)
            if doc.get("format") != LISTING_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {LISTING_FORMAT!r}")
            records = [FileRecord(str(f["name"]), int(f["size"]), str(f["sha256"]), str(f.get("etag", "")))
                       for f in doc["files"]]
            return cls(str(doc.get("source", "")), {r.name: r for r in records}, str(doc.get("written_at", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{uri} is not a model listing written by stage-model ({err}); "
                              "the destination holds something else") from err


def read_listing(store: ObjectStore, uri: str) -> Listing | None:
    """The listing at `uri`, or None where there is none."""
    try:
        data = store.read_bytes(uri)
    except ObjectNotFoundError:
        return None
    return Listing.from_bytes(data, uri)


def differences(listing: Listing, local: dict[str, FileRecord], hashed: bool = True) -> list[str]:
    """How a listing differs from the files about to be staged (empty: the same model, maybe with more files).

    `hashed=False` compares names and sizes only: the check that can refuse before a single file is hashed.
    """
    found = []
    for name, record in sorted(listing.files.items()):
        mine = local.get(name)
        if mine is None:
            found.append(f"{name} is not in the source")
        elif mine.size != record.size:
            found.append(f"{name} differs ({record.size:,} bytes, the source's {mine.size:,})")
        elif hashed and mine.sha256 != record.sha256:
            found.append(f"{name} differs (sha256 {record.sha256[:12]}..., the source's {mine.sha256[:12]}...)")
    return found
