"""No backend reachable: the route's static response is a normal ChatCompletion (and, when
streamed, a normal chunk stream)."""

from _sdk import client, run, tollgate_headers

MESSAGES = [{"role": "user", "content": "hello"}]


def main():
    c = client()
    raw = c.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    r = raw.parse()
    out = {
        "type": type(r).__name__,
        "object": r.object,
        "model": r.model,
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "usage": None if r.usage is None else {
            "prompt_tokens": r.usage.prompt_tokens,
            "completion_tokens": r.usage.completion_tokens,
            "total_tokens": r.usage.total_tokens,
        },
        "status": raw.status_code,
        "headers": tollgate_headers(raw.headers),
    }
    out["stream"] = stream(c)
    out["stream_usage"] = stream(c, stream_options={"include_usage": True})
    return out


def stream(c, **kw):
    chunks = []
    for ch in c.chat.completions.create(model="chat", messages=MESSAGES, stream=True, **kw):
        chunks.append(ch.model_dump(mode="json", exclude_unset=True))
    return {
        "types": sorted({ch.get("object") for ch in chunks}),
        "content": "".join(
            (choice.get("delta") or {}).get("content") or "" for ch in chunks for choice in ch.get("choices", [])
        ),
        "finish_reasons": [choice.get("finish_reason") for ch in chunks for choice in ch.get("choices", [])],
        "count": len(chunks),
        "last_usage": chunks[-1].get("usage") if chunks else None,
    }


run(main)
