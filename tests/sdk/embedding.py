"""An embedding through the sidecar (the SDK asks for base64 unless told; the mock answers floats)."""

from _sdk import client, run, tollgate_headers


def main():
    c = client()
    raw = c.embeddings.with_raw_response.create(model="embed", input=["a", "b"])
    r = raw.parse()
    return {
        "type": type(r).__name__,
        "object": r.object,
        "model": r.model,
        "count": len(r.data),
        "indices": [d.index for d in r.data],
        "embeddings": [list(d.embedding) for d in r.data],
        "usage": {"prompt_tokens": r.usage.prompt_tokens, "total_tokens": r.usage.total_tokens},
        "status": raw.status_code,
        "headers": tollgate_headers(raw.headers),
    }


run(main)
