"""Streaming through the sidecar vs direct to the mock, with and without
stream_options.include_usage. Order of calls (the Rust test reads the mock's log in this order):
direct plain, sidecar plain, direct with usage, sidecar with usage."""

import os
import time

from _sdk import client, run

MESSAGES = [{"role": "user", "content": "say hello world"}]


def collect(c, model, include_usage):
    kw = {}
    if include_usage:
        kw["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    chunks, times = [], []
    stream = c.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw)
    for ch in stream:
        times.append(round(time.monotonic() - t0, 4))
        # exclude_unset: only the keys that were on the wire (a "usage": null shows up).
        chunks.append(ch.model_dump(mode="json", exclude_unset=True))
    content = "".join(
        (choice.get("delta") or {}).get("content") or "" for ch in chunks for choice in ch.get("choices", [])
    )
    return {
        "chunks": chunks,
        "times": times,
        "count": len(chunks),
        "content": content,
        "pieces": [(choice.get("delta") or {}).get("content") for ch in chunks for choice in ch.get("choices", [])],
        # A usage chunk: empty choices or a non-null usage.
        "usage_chunks": [ch for ch in chunks if not ch.get("choices") or ch.get("usage") is not None],
        "last_usage": chunks[-1].get("usage") if chunks else None,
        "headers": {k: v for k, v in stream.response.headers.items() if k.lower().startswith("x-tollgate-") or k.lower() == "content-type"},
    }


def main():
    upstream_model = os.environ["UPSTREAM_MODEL"]
    direct = client(base_url=os.environ["MOCK_BASE_URL"])
    sidecar = client()
    return {
        "direct_plain": collect(direct, upstream_model, False),
        "sidecar_plain": collect(sidecar, "chat", False),
        "direct_usage": collect(direct, upstream_model, True),
        "sidecar_usage": collect(sidecar, "chat", True),
    }


run(main)
