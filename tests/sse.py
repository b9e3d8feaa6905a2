"""A test helper: strict parsing of the Server-Sent Events the ingress streams (tests/serve and tests/unit)."""

from __future__ import annotations

import json


def parse_sse(raw: bytes) -> list[tuple[str, dict]]:
    """Strict SSE framing: blocks of exactly ``event: <type>`` and one ``data: <json>`` line, each ended by a
    blank line; the event name equals the data's ``type``."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-80:]
    out = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:200]
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name
        out.append((name, data))
    return out
