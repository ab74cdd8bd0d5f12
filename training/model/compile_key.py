"""Digests that the model's Triton ops take as an argument, so that torch.compile's caches can tell
their graphs apart.

AOTAutograd's cache keys a compiled graph on the graph Dynamo traced: the ops and their arguments.
A `torch.library.triton_op`'s launcher runs later, when AOTAutograd traces the op, so neither the
module settings it reads (tile sizes) nor the source of the kernels it launches are in that key. A
second compile under other tiles (a tile sweep's next setting), or of edited kernels (a second
checkout on the same machine), could then get the first compile's kernels from the cache. The
whole training step is served from that cache, so every op module with a launcher has a
`launch_settings()`, made with these helpers, which its ops take as an argument they do not read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_digest(*paths: Path) -> str:
    """sha1 of the files' bytes, in order: the launchers and the kernels they launch."""
    digest = hashlib.sha1()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def settings_digest(*settings: object) -> str:
    """16 hex digits of the sha1 of the settings' repr (the same from process to process, so a warm
    cache still hits; containers of plain values only, whose repr holds no address)."""
    return hashlib.sha1(repr(settings).encode()).hexdigest()[:16]
